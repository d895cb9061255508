"""The fused MoE expert-MLP part of the kernel benchmark (T = 1..256 tokens at the families' expert shapes)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from benchmarks.kernel_bench.dense import _fake_rows, mma_variants
from benchmarks.kernel_bench.harness import (
    FAMILIES,
    MOE_T,
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
from kernels.moe import (
    MoEConfig,
    default_moe_config,
    fused_moe,
    mma_moe_config,
    moe_align,
    prepare_moe_weights,
)
from kernels.quantize import quantize_rows
from trace.rollout.forward import routed_experts


def moe_variants(T, k, E):
    """Tile configs of ours swept with --sweep: the default, the MMA tiles (also with the fp32 decode) and, at
    up to 8 rows per expert, the v1 GEMV."""
    d0, dm = default_moe_config(T, k, E), mma_moe_config(T, k, E)
    vs = [d0]
    for c in mma_variants(dm) + [dataclasses.replace(dm, bf16_decode=False)]:
        if c not in vs:
            vs.append(c)
    if T * k / E <= 8:
        for bm in (1, 2, 4):
            for bn, uu in [(16, 1), (32, 1), (32, 2), (64, 1)]:
                c = MoEConfig(BM=bm, BN=bn, BN_down=bn, num_warps=4, num_stages=1, kind="gemv", U=uu)
                if c not in vs:
                    vs.append(c)
    return vs


def pair_moe_config(cfg):
    """The MoE tile `cfg` with v5j's weights in the pair order (BM 64: its K-tiles of 64 in 4 stages)."""
    return dataclasses.replace(cfg, dot_order=False, **(dict(BKW=8, num_stages=4) if cfg.BM == 64 else {}))


def route(T, E, k, dev):
    logits = torch.randn(T, E, device=dev)
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    return ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def w4a4_bf16_moe(x, ids, tw, w13, w2):
    """The rollout engine's routed experts above its kernels' crossover: its own code
    (trace/rollout/forward.py `routed_experts`, with the routing sort inside) on x [T, H], ids / tw [T, k],
    the dequantized weights w13 [E, 2I, H] (gate | up) and w2 [E, H, I]. -> [T, H]."""
    return routed_experts(x, ids.long(), tw, w13, w2, _fake_rows, _fake_rows)


def moe_tol(act_quant):
    """Relative error allowed against the oracle: W4A4's bf16 rounding of h flips a few FP4 codes of the down
    input."""
    return 6e-2 if act_quant else 2e-2


def check_moe(dev):
    """The fused MoE against the oracle per family on fresh data (T = 5, some experts empty): W4A16 and W4A4, the
    default config and the MMA tile with both decodes, and the engine's BF16-GEMM path above the crossover."""
    for fam in STATE.get("families") or FAMILIES:  # correctness per family, odd T, some experts empty
        H, I, E, k = FAMILIES[fam]
        T = 5
        g, u, d = nv_weight((E, I, H), dev, "expert"), nv_weight((E, I, H), dev, "expert"), nv_weight((E, H, I), dev, "expert")
        mw = prepare_moe_weights(g, u, d)
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        ids, tw = route(T, E, k, dev)
        for aq in (False, True):
            e = relerr(fused_moe(x, mw, ids, tw, act_quant=aq), ref.moe_fp4_reference(x.float(), g, u, d, ids, tw, act_quant=aq))
            tol = moe_tol(aq)
            check(f"moe {fam} T{T} {'w4a4' if aq else 'w4a16'}", e < tol, f"rel err {e:.2e} (tol {tol:g}, bf16 h and output)")
            for bd in (False, True):  # the MMA tile (the default above 1.5 rows per expert), both decodes
                cm = MoEConfig(BM=16, BN=64, BKW=16, num_warps=4, num_stages=3, BN_down=64, bf16_decode=bd)
                e = relerr(fused_moe(x, mw, ids, tw, act_quant=aq, config=cm),
                           ref.moe_fp4_reference(x.float(), g, u, d, ids, tw, act_quant=aq))
                check(f"moe {fam} T{T} {'w4a4' if aq else 'w4a16'} mma {'bf16' if bd else 'fp32'}-decode", e < tol,
                      f"rel err {e:.2e} (tol {tol:g})")
        # the W4A4 tile with the activation quantize fused into both launches (MoEConfig.fuse_quant): the oracle's
        # tolerance, and whether it is the unfused tile's output bit for bit (as in the interpreter)
        cm = mma_moe_config(T, k, E)
        r4 = ref.moe_fp4_reference(x.float(), g, u, d, ids, tw, act_quant=True)
        yf = fused_moe(x, mw, ids, tw, act_quant=True, config=dataclasses.replace(cm, fuse_quant=True))
        e = relerr(yf, r4)
        same = torch.equal(yf, fused_moe(x, mw, ids, tw, act_quant=True, config=cm))
        check(f"moe {fam} T{T} w4a4 mma fused-quant", e < moe_tol(True),
              f"rel err {e:.2e} (tol {moe_tol(True):g}); bit-equal to the unfused tile: {same}")
        w13 = torch.cat([ref.nvfp4_dequantize(*g), ref.nvfp4_dequantize(*u)], 1).to(torch.bfloat16)
        w2 = ref.nvfp4_dequantize(*d).to(torch.bfloat16)
        e = relerr(w4a4_bf16_moe(x, ids, tw, w13, w2), ref.moe_fp4_reference(x.float(), g, u, d, ids, tw, act_quant=True))
        check(f"moe {fam} T{T} w4a4 on bf16 gemms", e < 6e-2, f"rel err {e:.2e} (tol 6e-2, bf16 h and output)")
        del g, u, d, mw, w13, w2


def run_moe(dev, quick):
    log("== grouped MoE FP4 (routed-expert MLP of one layer)")
    check_moe(dev)
    tk = load_anchor()
    fams = STATE.get("families") or (["qwen3-30b-a3b", "mixtral-8x7b"] if quick else list(FAMILIES))
    for fam in fams:
        time_moe_family(dev, quick, tk, fam)


def time_moe_family(dev, quick, tk, fam):
    """Time one family's routed-expert MLP at each T: ours (default and MMA configs, W4A16 and W4A4), BF16
    grouped GEMMs, the engine's BF16-GEMM path and, where installed, `triton_kernels` (tk)."""
    H, I, E, k = FAMILIES[fam]
    g, u, d = nv_weight((E, I, H), dev, "expert"), nv_weight((E, I, H), dev, "expert"), nv_weight((E, H, I), dev, "expert")
    mw = prepare_moe_weights(g, u, d)
    w13 = torch.cat([ref.nvfp4_dequantize(*g), ref.nvfp4_dequantize(*u)], 1).to(torch.bfloat16)  # [E, 2I, H]
    w2 = ref.nvfp4_dequantize(*d).to(torch.bfloat16)  # [E, H, I]
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, H, 2I], [E, I, H] (K-major views)
    anc = None
    if tk is not None:
        try:
            anc = tk.MoELayer(w13t.contiguous(), w2t.contiguous(), k)
            x = torch.randn(3, H, device=dev, dtype=torch.bfloat16)
            st, aids, _ = anc.route(torch.randn(3, E, device=dev, dtype=torch.float16))
            e = relerr(anc(x, st), anc.reference(x, aids))
            check(f"triton_kernels moe mxfp4 {fam} T3", e < 2e-2, f"rel err {e:.2e} vs its dequantized weights (bf16 h)")
            anc.deq1 = anc.deq2 = None
        except Exception as ex:
            note("moe", f"triton_kernels {fam} failed: {type(ex).__name__}: {str(ex)[:300]}")
            anc = None
    for T in STATE.get("T") or (MOE_T if not quick else (1, 16, 256)):
        shape = f"{fam} T{T}"
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        logits = torch.randn(T, E, device=dev)
        tw, ids = torch.softmax(logits, -1).topk(k, -1)
        ids, tw = ids.int(), (tw / tw.sum(-1, keepdim=True)).float()
        flat = ids.reshape(-1).long()
        counts = torch.bincount(flat, minlength=E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        hit = int((counts > 0).sum())
        xs = x[torch.argsort(flat, stable=True) // k].contiguous()  # expert-sorted rows

        def bf16_moe():
            h = torch._grouped_mm(xs, w13t, offs=offs)
            return torch._grouped_mm(F.silu(h[:, :I]) * h[:, I:], w2t, offs=offs)
        S = T * k
        act_bytes = T * H * 2 + S * I * 2 * 2 + S * H * 2 + T * H * 2
        base = record("moe", shape, "bf16-grouped_mm", bench(bf16_moe), hit * 3 * H * I * 2 + act_bytes,
                      note=f"experts_hit={hit}")
        a_ms = None
        if anc is not None:
            try:
                st, aids, _ = anc.route(logits.half())
                ahit = int(torch.unique(aids).numel())
                a_ms = record("moe", shape, "triton_kernels-mxfp4", bench(lambda: anc(x, st)),
                              ahit * 3 * H * I * (0.5 + 1 / 32) + act_bytes, base, note=f"experts_hit={ahit}")
            except Exception as ex:
                note("moe", f"triton_kernels {shape} failed: {type(ex).__name__}: {str(ex)[:300]}")
        fp4_bytes = hit * 3 * H * I * (0.5 + 1 / 16) + act_bytes
        cfg = default_moe_config(T, k, E)
        al = moe_align(ids, E, cfg.BM)
        record("moe", shape, "fp4-w4a16", bench(lambda: fused_moe(x, mw, ids, tw, config=cfg, align=al, check_finite=False)),
               fp4_bytes, base, a_ms, cfg_str(cfg), f"experts_hit={hit}")
        record("moe", shape, "fp4-w4a4", bench(lambda: fused_moe(x, mw, ids, tw, act_quant=True, check_finite=False)),
               fp4_bytes, base, a_ms, "default;+2 act-quant launches;routing align inside", f"experts_hit={hit}")
        cm0 = mma_moe_config(T, k, E)  # the MMA tile (the default's above the GEMV's crossover)
        # the W4A16 oracle of the checked variants below (the crossover's where the GEMV is the default, the tile
        # sweep's from T 16)
        r16 = ref.moe_fp4_reference(x.float(), g, u, d, ids, tw) if cfg.kind != "mma" or T >= 16 else None
        if cfg.kind != "mma":  # the default is the decode GEMV: the MMA tile too, for the crossover
            for aq in (False, True):
                prov = f"fp4-w4a{4 if aq else 16}-mma"
                r = ref.moe_fp4_reference(x.float(), g, u, d, ids, tw, act_quant=True) if aq else r16
                aligns = {}

                def fn(c, aq=aq):  # W4A16 with the routing precomputed, W4A4 with it inside (as the rows above)
                    al2 = None if aq else aligns.setdefault(c.BM, moe_align(ids, E, c.BM))
                    return lambda: fused_moe(x, mw, ids, tw, act_quant=aq, config=c, align=al2, check_finite=False)
                t, cm = timed_best(fn, mma_variants(cm0), "moe", shape, prov, base, oracle=(r, moe_tol(aq)))
                if t:
                    record("moe", shape, prov, t, fp4_bytes, base, a_ms,
                           cfg_str(cm) + (";+2 act-quant launches;routing align inside" if aq else ""),
                           f"experts_hit={hit}")
                del r
        # the MMA tile at the slots per block the default did not pick (`kernels.moe.moe_block_rows` chose its BM
        # from the expected blocks per expert; kernels/NOTES.md v5c, v5e): each variant checked, a sweep row each,
        # the best as -best. K-tiles twice the default's were slower at every size timed (v5d rows) and are not
        # swept
        if T >= 16:
            variants = [dataclasses.replace(cm0, BM=bm) for bm in (16, 32, 64) if bm != cm0.BM]
            aligns = {c.BM: moe_align(ids, E, c.BM) for c in variants}
            t, cm = timed_best(lambda c: (lambda: fused_moe(x, mw, ids, tw, config=c, align=aligns[c.BM],
                                                            check_finite=False)),
                               variants, "moe", shape, "fp4-w4a16-tile", base, oracle=(r16, moe_tol(False)))
            if t:
                record("moe", shape, "fp4-w4a16-tile-best", t, fp4_bytes, base, a_ms, cfg_str(cm),
                       f"experts_hit={hit}")
        if cfg.kind == "mma":  # the tile's A/B of weight orders: the pair order beside the default dot order
            for aq in (False, True):
                r = ref.moe_fp4_reference(x.float(), g, u, d, ids, tw, act_quant=True) if aq else r16
                cp = pair_moe_config(cfg)
                al2 = moe_align(ids, E, cp.BM)
                t, cm = timed_best(lambda c, aq=aq: (lambda: fused_moe(x, mw, ids, tw, act_quant=aq, config=c,
                                                                       align=None if aq else al2, check_finite=False)),
                                   [cp], "moe", shape, f"fp4-w4a{4 if aq else 16}-pair", base, oracle=(r, moe_tol(aq)))
                if t:
                    record("moe", shape, f"fp4-w4a{4 if aq else 16}-pair", t, fp4_bytes, base, a_ms,
                           cfg_str(cm) + (";+2 act-quant launches;routing align inside" if aq else ""),
                           f"experts_hit={hit}")
                del r
        # the W4A4 tile with the activation quantize fused into both launches (MoEConfig.fuse_quant: no quantize
        # launches, each N-tile program quantizes its rows again) beside the unfused fp4-w4a4 row(s); the same tile
        # config as the MMA rows, routing align inside as theirs
        r = ref.moe_fp4_reference(x.float(), g, u, d, ids, tw, act_quant=True)
        t, cm = timed_best(lambda c: (lambda: fused_moe(x, mw, ids, tw, act_quant=True, config=c, check_finite=False)),
                           [dataclasses.replace(cm0, fuse_quant=True)], "moe", shape, "fp4-w4a4-fused", base,
                           oracle=(r, moe_tol(True)))
        if t:
            record("moe", shape, "fp4-w4a4-fused", t, fp4_bytes, base, a_ms,
                   cfg_str(cm) + ";act-quant fused;routing align inside", f"experts_hit={hit}")
        del r, r16
        # the engine's path above its crossover: the same activation codes on BF16 grouped GEMMs
        record("moe", shape, "w4a4-bf16gemm", bench(lambda: w4a4_bf16_moe(x, ids, tw, w13, w2)),
               hit * 3 * H * I * 2 + act_bytes, base, a_ms, "+2 act-quant launches;routing sort inside",
               f"experts_hit={hit}")
        # where W4A4 time goes beyond W4A16: the routing sort (inside the call above, precomputed for
        # the W4A16 row) and the two activation quantize launches
        record("moe-part", shape, "routing-align", bench(lambda: moe_align(ids, E, cfg.BM)))
        hq = torch.randn(S, I, device=dev, dtype=torch.bfloat16)
        record("moe-part", shape, "act-quantize+dequant x2",
               bench(lambda: (quantize_rows(x, "nvfp4", fake_dtype=x.dtype, check_finite=False),
                              quantize_rows(hq, "nvfp4", fake_dtype=hq.dtype, check_finite=False))))
        if STATE["sweep"]:
            aligns = {}

            def fn(c):
                al2 = aligns.setdefault(c.BM, moe_align(ids, E, c.BM))
                return lambda: fused_moe(x, mw, ids, tw, config=c, align=al2, check_finite=False)
            t, c = timed_best(fn, moe_variants(T, k, E), "moe", shape, "fp4-w4a16", base)
            if t:
                record("moe", shape, "fp4-w4a16-best", t, fp4_bytes, base, a_ms, cfg_str(c), f"experts_hit={hit}")
    del g, u, d
    torch.cuda.empty_cache()
