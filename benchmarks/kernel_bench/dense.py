"""The dense FP4 GEMM / GEMV part of the kernel benchmark (decode rows M = 1..64 at the families' layer shapes)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from benchmarks.kernel_bench.harness import (
    DENSE_M,
    STATE,
    bench,
    cfg_str,
    check,
    load_anchor,
    log,
    note,
    nv_weight,
    record,
    relerr,
    timed_best,
)
from kernels import reference as ref
from kernels.gemm import GemmConfig, auto_config, default_config, fp4_linear, prepare_weight
from kernels.moe import (
    MoEConfig,
)
from kernels.quantize import fake_rows, quantize_rows


def _fake_rows(t):
    """The engine's activation quantize above its crossover (EngineForward._act_fast): rows of t [..., K]
    through the quantize kernel, its dequantized copy back in t's shape."""
    return fake_rows(t.reshape(-1, t.shape[-1])).view(t.shape)


def w4a4_bf16_linear(x, wb):
    """The rollout engine's dense projection above its kernels' crossover (trace/rollout/fast.py): the
    quantize kernel's dequantized activation rows times the dequantized weight wb [N, K] on BF16 GEMMs."""
    return F.linear(_fake_rows(x), wb)


MMA_TILES = [(16, 64, 4, 3), (16, 64, 4, 4), (32, 64, 4, 3), (8, 64, 4, 4), (16, 128, 8, 3)]


def mma_variants(d):
    """The MMA config d (dense `default_config`, or MoE `mma_moe_config`, whose down GEMM takes the same
    weight rows) and tiles around it (same BM and split-K): K-tiles of 64 to 256 elements, 64 or 128 weight
    rows, 3-4 stages, the bf16 decode."""
    vs = [d]
    for bkw, bn, w, st in MMA_TILES:
        rows = dict(BN=bn, BN_down=bn) if isinstance(d, MoEConfig) else dict(BN=bn)
        c = dataclasses.replace(d, BKW=bkw, num_warps=w, num_stages=st, bf16_decode=True, **rows)
        if c not in vs:
            vs.append(c)
    return vs


def dense_variants(M, N, K, dev):
    """Tile configs of ours swept with --sweep: the MMA tiles (also with the fp32 decode, and without split-K),
    and for M <= 16 the v1 GEMV layout."""
    from kernels.gemm import gemv2_config
    d = default_config(M, N, K, dev)
    vs = mma_variants(d)
    for c in (dataclasses.replace(d, bf16_decode=False), dataclasses.replace(d, split=1)):
        if c not in vs:
            vs.append(c)
    if M <= 16:
        g = gemv2_config(M, N, K, dev)
        for bn, nw, u, sp in [(g.BN, g.num_warps, g.U, g.split), (64, 4, 2, g.split), (16, 4, 2, g.split),
                              (32, 4, 2, max(1, g.split // 2)), (32, 4, 2, g.split * 2)]:
            c = GemmConfig(kind="gemv2", BN=bn, BM=g.BM, split=sp, num_warps=nw, num_stages=1, U=u)
            if c not in vs:
                vs.append(c)
    return vs


def run_dense(dev, quick):
    log("== dense FP4 GEMM (decode rows M)")
    for M, N, K in [(1, 14336, 4096), (3, 4096, 14336), (37, 1000, 4112), (128, 4096, 2048)]:
        c, s, o = nv_weight((N, K), dev)
        pw = prepare_weight(c, s, o)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        for aq in (False, True):
            y = fp4_linear(x, pw, act_quant=aq)
            r = ref.fp4_linear(x.float(), c, s, o, act_quant=aq)
            e = relerr(y, r)
            det = f"rel err {e:.2e} (tol 1e-2, bf16 output)"
            if aq and not e < 1e-2:  # which kernel disagrees: the activation quantize or the W4A4 GEMM
                q = quantize_rows(x, "nvfp4")
                xc, xs, xo = ref.nvfp4_quantize(x.float().cpu(), outer="row")
                same = torch.equal(fp4_linear(x, pw, act_quant=True), y)  # False: not deterministic
                det += (f"; act codes equal {torch.equal(q.codes().cpu(), xc)}, scales {torch.equal(q.scales.cpu(), xs)}, "
                        f"S_enc {torch.equal(q.outer.cpu(), xo)}; repeat bit-equal {same}")
            check(f"dense {'w4a4' if aq else 'w4a16'} M{M} N{N} K{K}", e < 1e-2, det)
            for bd in (False, True):  # the MMA tile (the default above 2 rows) at every shape, both decodes
                cm = dataclasses.replace(default_config(M, N, K, x.device), bf16_decode=bd)
                e = relerr(fp4_linear(x, pw, act_quant=aq, config=cm), r)
                check(f"dense {'w4a4' if aq else 'w4a16'} M{M} N{N} K{K} mma {'bf16' if bd else 'fp32'}-decode", e < 1e-2,
                      f"rel err {e:.2e} (tol 1e-2)")
            if aq:  # the tile with the activation quantize fused (GemmConfig.fuse_quant): the oracle's tolerance, and
                #     whether it is the unfused tile's output bit for bit (split-K's atomics add in no fixed order)
                cm = default_config(M, N, K, x.device)
                yf = fp4_linear(x, pw, act_quant=True, config=dataclasses.replace(cm, fuse_quant=True))
                e = relerr(yf, r)
                same = torch.equal(yf, fp4_linear(x, pw, act_quant=True, config=cm))
                check(f"dense w4a4 M{M} N{N} K{K} mma fused-quant", e < 1e-2,
                      f"rel err {e:.2e} (tol 1e-2); bit-equal to the unfused tile: {same} (split {cm.split})")
    tk = load_anchor()
    shapes = [(14336, 4096), (4096, 14336)] + ([] if quick else [(11264, 2048), (2048, 5632)])
    for N, K in shapes:
        c, s, o = nv_weight((N, K), dev)
        pw = prepare_weight(c, s, o)
        wb = ref.nvfp4_dequantize(c, s, o).to(torch.bfloat16)  # [N, K]
        anc = None
        if tk is not None:
            try:
                anc = tk.Dense(wb.t().contiguous())
                x = torch.randn(5, K, device=dev, dtype=torch.bfloat16)
                e = relerr(anc(x), x.float() @ anc.deq.float())
                check(f"triton_kernels dense mxfp4 M5 N{N} K{K}", e < 1e-2, f"rel err {e:.2e} vs its dequantized weight")
                anc.deq = None
            except Exception as ex:
                note("dense", f"triton_kernels dense N{N} K{K} failed: {type(ex).__name__}: {str(ex)[:200]}")
                anc = None
        for M in STATE.get("M") or (DENSE_M if not quick else (1, 16, 64)):
            shape = f"M{M} N{N} K{K}"
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            io = M * K * 2 + M * N * 2
            base = record("dense", shape, "bf16-cublas", bench(lambda: F.linear(x, wb)), N * K * 2 + io)
            a_ms = None
            if anc is not None:
                try:
                    a_ms = record("dense", shape, "triton_kernels-mxfp4", bench(lambda: anc(x)), N * K * (0.5 + 1 / 32) + io,
                                  base)
                except Exception as ex:
                    note("dense", f"triton_kernels {shape} failed: {type(ex).__name__}: {str(ex)[:200]}")
            fp4_bytes = N * K * (0.5 + 1 / 16) + io
            # default configs = the engine's choice
            record("dense", shape, "fp4-w4a16", bench(lambda: fp4_linear(x, pw, check_finite=False)), fp4_bytes, base,
                   a_ms, "default")
            record("dense", shape, "fp4-w4a4", bench(lambda: fp4_linear(x, pw, act_quant=True, check_finite=False)),
                   fp4_bytes, base, a_ms, "default;+act-quant launch")
            r16 = ref.fp4_linear(x.float(), c, s, o)  # the W4A16 oracle of the checked variants below
            if M <= 2 and pw.gv_words is not None:  # the v1 decode GEMV, the default up to M 2 before v5k
                from kernels.gemm import gemv2_config
                for aq in (False, True):
                    r = ref.fp4_linear(x.float(), c, s, o, act_quant=True) if aq else r16
                    t, cm = timed_best(lambda cf, aq=aq: (lambda: fp4_linear(x, pw, act_quant=aq, config=cf,
                                                                             check_finite=False)),
                                       [gemv2_config(M, N, K, x.device)], "dense", shape, f"fp4-w4a{4 if aq else 16}-gemv",
                                       base, oracle=(r, 1e-2))
                    if t:
                        record("dense", shape, f"fp4-w4a{4 if aq else 16}-gemv", t, fp4_bytes, base, a_ms,
                               cfg_str(cm) + (";+act-quant launch" if aq else ""))
            if auto_config(M, N, K, x.device, pw.gv_words is not None).kind != "mma":
                # the default is the decode GEMV: the MMA tile too, for the crossover (best of a few tiles)
                for aq in (False, True):
                    prov = f"fp4-w4a{4 if aq else 16}-mma"
                    r = ref.fp4_linear(x.float(), c, s, o, act_quant=True) if aq else r16
                    t, cm = timed_best(lambda cf, aq=aq: (lambda: fp4_linear(x, pw, act_quant=aq, config=cf, check_finite=False)),
                                       mma_variants(default_config(M, N, K, x.device)), "dense", shape, prov, base,
                                       oracle=(r, 1e-2))
                    if t:
                        record("dense", shape, prov, t, fp4_bytes, base, a_ms,
                               cfg_str(cm) + (";+act-quant launch" if aq else ""))
            if auto_config(M, N, K, x.device, pw.gv_words is not None).kind == "mma":  # v5j's pair order (as the MoE's)
                for aq in (False, True):
                    r = ref.fp4_linear(x.float(), c, s, o, act_quant=True) if aq else r16
                    t, cm = timed_best(lambda cf, aq=aq: (lambda: fp4_linear(x, pw, act_quant=aq, config=cf,
                                                                             check_finite=False)),
                                       [dataclasses.replace(default_config(M, N, K, x.device), dot_order=False)],
                                       "dense", shape, f"fp4-w4a{4 if aq else 16}-pair", base, oracle=(r, 1e-2))
                    if t:
                        record("dense", shape, f"fp4-w4a{4 if aq else 16}-pair", t, fp4_bytes, base, a_ms,
                               cfg_str(cm) + (";+act-quant launch" if aq else ""))
            # the MMA tile with the activation quantize fused (GemmConfig.fuse_quant: no quantize launch) beside the
            # fp4-w4a4 row (the same tile unfused wherever the default is the MMA tile)
            r = ref.fp4_linear(x.float(), c, s, o, act_quant=True)
            t, cm = timed_best(lambda cf: (lambda: fp4_linear(x, pw, act_quant=True, config=cf, check_finite=False)),
                               [dataclasses.replace(default_config(M, N, K, x.device), fuse_quant=True)], "dense", shape,
                               "fp4-w4a4-fused", base, oracle=(r, 1e-2))
            if t:
                record("dense", shape, "fp4-w4a4-fused", t, fp4_bytes, base, a_ms, cfg_str(cm) + ";act-quant fused")
            del r
            # the engine's path above its crossover: the same activation codes on cuBLAS BF16
            record("dense", shape, "w4a4-bf16gemm", bench(lambda: w4a4_bf16_linear(x, wb)), N * K * 2 + io, base, a_ms,
                   "+act-quant launch")
            record("dense-part", shape, "act-quantize+dequant",  # the W4A4 decode path's extra launch
                   bench(lambda: quantize_rows(x, "nvfp4", fake_dtype=x.dtype, check_finite=False)),
                   M * K * (2 + 2 + 0.5 + 1 / 16) + 4 * M)  # x in, dequantized x out, codes, scales, S_enc
            if STATE["sweep"]:
                t, cfg = timed_best(lambda cfg: (lambda: fp4_linear(x, pw, config=cfg, check_finite=False)),
                                    dense_variants(M, N, K, dev), "dense", shape, "fp4-w4a16", base)
                if t:
                    record("dense", shape, "fp4-w4a16-best", t, fp4_bytes, base, a_ms, cfg_str(cfg))
        torch.cuda.empty_cache()
