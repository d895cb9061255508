"""GPU benchmark of the FP4 Triton kernels against PyTorch BF16 and OpenAI's `triton_kernels`, in one run.

What: (1) measures the copy-bandwidth ceiling; (2) checks every kernel on the GPU against
`kernels/reference.py` on fresh random data (bit-exact codes/scales for quantize; relative error for
GEMM / MoE / attention); (3) times each kernel, its PyTorch BF16 counterpart (cuBLAS `F.linear`,
`torch._grouped_mm`, SDPA) and, where installed, the `triton_kernels` MXFP4 kernels
(benchmarks/anchor_triton_kernels.py; skipped with a message otherwise) at the real layer shapes of the
four model families: MoE expert MLP at T = 1, 4, 16, 64, 256 tokens, dense decode at M = 1..64 rows;
(4) APPENDS one row per measurement and per check to the long table `--out` (default
results/kernels/kernels.csv; schema `benchmarks.results_table.KERNEL_FIELDS`): median/p20/p80 us,
ratio_vs_bf16 and ratio_vs_anchor (same-run medians: baseline / this), GB/s over the minimal bytes and
that as % of the copy bandwidth measured at the start of the run.

Timing: every provider is captured in a CUDA graph (Python launch overhead excluded for all sides) and
replayed under `triton.testing.do_bench` (L2 flushed before every replay). MoE: our routing (top-k,
sort/pad by expert) is precomputed and shared by ours and BF16 (the BF16 side times
grouped_mm(gate_up) + silu*mul + grouped_mm(down) on expert-sorted rows, no gather/scatter); the anchor
uses its own routing structures from the same logits and does gather, SwiGLU and the scatter-sum inside
its two kernels. Minimal bytes: weights of the experts actually hit read once (FP4: codes + scales),
activations read once, outputs written once. Qwen1.5-MoE's shared expert is not part of the timed layer.
Provider `w4a4-bf16gemm` is what the rollout engine runs above its kernels' crossover (trace/rollout/fast.py):
the same activation codes through the quantize kernel's dequantized copy into BF16 GEMMs on the dequantized
weights (MoE: with the engine's own routing sort inside), so `fp4-w4a4` against it is the crossover.
Rows `fp4-w4a16` / `fp4-w4a4` run the default configs (the engine's choice). Where that is the decode GEMV
(dense up to M=2, MoE up to 1.5 (token, slot) rows per expert), rows `fp4-w4a16-mma` / `fp4-w4a4-mma` time
the MMA tile as well (best of a few tiles, each checked against the oracle first), so one run gives the
GEMV / MMA / BF16 crossover of the engine (trace/rollout/fast.py, benchmarks/crossover.py).

Run (repo root, on a GPU): `PYTHONPATH=. python benchmarks/bench_kernels.py --version v1b`
(`--quick` for a subset, `--only moe,dense`, `--families mixtral-8x7b` for the MoE shapes, `--T 1 4 16 64 256` / `--M 1 2 4 8 16` for the sizes, `--sweep` to
also time tile-config variants of ours).
Offline SASS counts (no GPU): `--sass`. Plot: `python -m figures.plot_kernels --out figures/gpu`.
Over 450 lines because the four kernels' checks and timings share one harness and one run: one GPU
call measures everything against the same copy-bandwidth ceiling.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton

from benchmarks import anchor_triton_kernels as anchor_mod
from benchmarks.results_table import KERNEL_FIELDS, append, git_commit, today
from kernels import reference as ref
from kernels.attention import FP4KVCache, decode_attention, kv_store
from kernels.gemm import GemmConfig, auto_config, default_config, fp4_linear, prepare_weight
from kernels.moe import (
    MoEConfig,
    default_moe_config,
    fused_moe,
    mma_moe_config,
    moe_align,
    prepare_moe_weights,
)
from kernels.quantize import fake_rows, quantize_rows
from trace.rollout.forward import routed_experts

FAMILIES = {  # name: (H, I, E, topk); trace/models/registry.py
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "olmoe-1b-7b": (2048, 1024, 64, 8),
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
}
MOE_T = (1, 4, 16, 64, 256)
DENSE_M = (1, 2, 4, 8, 16, 32, 64)
RUN = dict(version="dev", commit="unknown", gpu="cpu", date="")
STATE = dict(out=None, copy_gbps=None, sweep=False, T=None, M=None, families=None)
ROWS: list[dict] = []


def log(*a):
    print(*a, flush=True)


def _emit(row: dict) -> dict:
    row = {**RUN, **row}
    ROWS.append(row)
    if STATE["out"]:
        append(STATE["out"], [row], KERNEL_FIELDS)
    return row


def bench(fn, graph=True):
    """-> (median, p20, p80) ms of fn, captured in a CUDA graph and replayed with an L2 flush."""
    fn()
    torch.cuda.synchronize()
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    q = triton.testing.do_bench(run, warmup=20, rep=100, quantiles=[0.5, 0.2, 0.8])
    return tuple(float(v) for v in q)


def timing_row(op, shape, provider, t, nbytes=None, base_ms=None, anchor_ms=None, config="", note="") -> dict:
    """One measurement as a table row (t = (median, p20, p80) ms; nbytes = minimal bytes moved)."""
    med, p20, p80 = t
    gbps = nbytes / (med * 1e-3) / 1e9 if nbytes else None
    cb = STATE["copy_gbps"]
    return dict(op=op, shape=shape, provider=provider, median_us=round(med * 1e3, 3), p20_us=round(p20 * 1e3, 3),
                p80_us=round(p80 * 1e3, 3), ratio_vs_bf16=round(base_ms / med, 3) if base_ms else "",
                ratio_vs_anchor=round(anchor_ms / med, 3) if anchor_ms else "",
                gb_per_s=round(gbps, 1) if gbps else "", pct_copy_bw=round(100 * gbps / cb, 1) if (gbps and cb) else "",
                ok="", config=config, note=note)


def record(op, shape, provider, t, nbytes=None, base_ms=None, anchor_ms=None, config="", note=""):
    """Time row appended to the table and printed; returns the median in ms."""
    r = _emit(timing_row(op, shape, provider, t, nbytes, base_ms, anchor_ms, config, note))
    log(f"  {op:10s} {shape:30s} {provider:24s} {r['median_us']:9.1f} us {r['pct_copy_bw']!s:>5}%copy "
        f"x{r['ratio_vs_bf16']!s:>6} bf16 x{r['ratio_vs_anchor']!s:>6} anchor {config}")
    return t[0]


def sweep_row(op, shape, provider, t, base_ms, config):
    _emit(timing_row(op + "-sweep", shape, provider, t, base_ms=base_ms, config=config))


def check(name, ok, detail):
    _emit(dict(op="check", shape=name, ok=bool(ok), note=detail))
    log(f"  CHECK {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    return bool(ok)


def note(op, detail):
    """A run-level remark in the table (e.g. a provider that was skipped, and why)."""
    _emit(dict(op=op, shape="", provider="note", note=detail))


def relerr(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def nv_weight(shape, dev, outer="tensor"):
    w = torch.randn(*shape, device=dev) * 0.02
    return ref.nvfp4_quantize(w, outer=outer)


def load_anchor():
    """The triton_kernels provider module, or None (the reason is printed once and noted in the table)."""
    if anchor_mod.load() is None:
        note("anchor", anchor_mod.skip_reason())
        return None
    return anchor_mod


def cfg_str(c):
    return ";".join(f"{k}={v}" for k, v in c.__dict__.items())


def timed_best(fn_of_cfg, variants, op, shape, provider, base_ms, oracle=None):
    """Time fn_of_cfg(cfg) for each variant (a sweep row each); -> (best t, best cfg) or (None, None).
    oracle: (reference output, tolerance): each variant's output is checked against it first (a check row);
    a variant that fails is not timed."""
    best = (None, None)
    for cfg in variants:
        try:
            fn = fn_of_cfg(cfg)
            if oracle is not None:
                e = relerr(fn(), oracle[0])
                if not check(f"{op} {shape} {provider} {cfg_str(cfg)}", e < oracle[1],
                             f"rel err {e:.2e} (tol {oracle[1]:g})"):
                    continue
            t = bench(fn)
        except Exception as ex:  # a config that fails to compile is skipped, not fatal
            log(f"  variant {cfg} failed: {type(ex).__name__}: {str(ex)[:200]}")
            continue
        if len(variants) > 1:
            sweep_row(op, shape, provider, t, base_ms, cfg_str(cfg))
        if best[0] is None or t[0] < best[0][0]:
            best = (t, cfg)
    return best


# ------------------------------------------------------------------------------------------------
def bench_copy(dev):
    n = 1 << 29  # 1 GiB of bytes (bf16 512M elements)
    a = torch.empty(n // 2, dtype=torch.bfloat16, device=dev).normal_()
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a), graph=False)
    STATE["copy_gbps"] = 2 * n / (t[0] * 1e-3) / 1e9
    record("memcpy", "1GiB d2d", "torch-copy", t, 2 * n)
    return STATE["copy_gbps"]


def run_quantize(dev, quick):
    log("== activation quantize")
    for M, K in [(256, 4096), (33, 6144), (128, 2048)]:  # 1 row of 256 / 512 blocks, 2 rows of 128 per program
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16) * torch.exp(torch.randn(M, 1, device=dev) * 2)
        x[0, :64] = 0
        for fmt in ("nvfp4", "mxfp4"):
            q = quantize_rows(x, fmt, guidance=True, fake_dtype=torch.bfloat16)
            q = type(q)(q.packed.cpu(), q.scales.cpu(), q.outer.cpu(), q.mantissa.cpu(), fmt, q.fake.cpu())
            q0 = quantize_rows(x, fmt)  # the variant the W4A4 GEMM calls (no mantissa bits, no dequantized output)
            plain = torch.equal(q0.packed.cpu(), q.packed) and torch.equal(q0.scales.cpu(), q.scales)
            xc = x.cpu()  # the oracle runs on the CPU: on CUDA, torch evaluates `t / 6.0` as t * (1/6) (see NOTES.md)
            if fmt == "nvfp4":
                c, s, o = ref.nvfp4_quantize(xc.float(), outer="row")
                ok = torch.equal(q.outer, o)
                deq = ref.nvfp4_dequantize(c, s, o)
            else:
                c, s = ref.mxfp4_quantize(xc.float())
                ok = True
                deq = ref.mxfp4_dequantize(c, s)
            parts = dict(outer=ok, codes=torch.equal(q.packed, ref.pack_fp4(c)), scales=torch.equal(q.scales, s),
                         mant=torch.equal(q.mantissa, ref.pack_bits(c & 1)),
                         fake_bf16=float((q.fake != deq.to(torch.bfloat16)).float().mean()) < 1e-3, plain=plain)
            det = {k2: v2 for k2, v2 in parts.items()}
            if not all(parts.values()):
                bad = (ref.unpack_fp4(q.packed) != c).nonzero()[:3].tolist()
                sb = (q.scales != s).nonzero()[:3].tolist()
                det.update(first_code_mismatch=bad, first_scale_mismatch=sb,
                           outer_mismatch=int((q.outer != o).sum()) if fmt == "nvfp4" else 0)
                if not plain:  # the codes-only variant against the guidance variant (equal to the oracle or not)
                    pc = ref.unpack_fp4(q0.packed.cpu()) != ref.unpack_fp4(q.packed)
                    det.update(plain_codes_differ=int(pc.sum()), plain_first_code=pc.nonzero()[:3].tolist(),
                               plain_scales_differ=int((q0.scales.cpu() != q.scales).sum()),
                               plain_repeat_equal=torch.equal(quantize_rows(x, fmt).packed.cpu(), q0.packed.cpu()))
                if sb:
                    r0, b0 = sb[0]
                    det.update(kernel_scale=int(q.scales[r0, b0]), ref_scale=int(s[r0, b0]),
                               amax=float(xc[r0, b0 * 16:(b0 + 1) * 16].float().abs().max()), outer=float(o[r0, 0]) if fmt == "nvfp4" else 0)
            check(f"quantize {fmt} {M}x{K} bit-exact", all(parts.values()), json.dumps(det))
            # the rounding by threshold compares (fma_rtn=False; the default rounds on the FMA pipe), plain and with
            # guidance bits, against the oracle
            for name, kw in (("compares", dict(fma_rtn=False)),):
                qf, qg = quantize_rows(x, fmt, **kw), quantize_rows(x, fmt, guidance=True, **kw)
                fparts = dict(codes=torch.equal(qf.packed.cpu(), ref.pack_fp4(c)), scales=torch.equal(qf.scales.cpu(), s),
                              guide_codes=torch.equal(qg.packed.cpu(), ref.pack_fp4(c)),
                              mant=torch.equal(qg.mantissa.cpu(), ref.pack_bits(c & 1)))
                if fmt == "nvfp4":
                    fparts["outer"] = torch.equal(qf.outer.cpu(), o)
                fparts["codes_differ"] = int((ref.unpack_fp4(qf.packed.cpu()) != c).sum())
                check(f"quantize {fmt} {M}x{K} {name} bit-exact",
                      all(v is True for k, v in fparts.items() if k != "codes_differ"), json.dumps(fparts))
    # 16384x2048: one 2048-wide chunk per row, the tile v2k moved to 8 warps (Qwen3-30B-A3B's hidden width)
    shapes = [(8192, 4096), (16384, 2048)] + ([] if quick else [(256, 2048), (4096, 14336)])
    for M, K in shapes:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        # (format, guidance bits, dequantized rows, rounding on the FMA pipe (the default) or by compares ("-cmp"))
        for fmt, guide, fake, fma in (("nvfp4", False, False, True), ("nvfp4", True, False, True),
                                      ("mxfp4", False, False, True), ("nvfp4", False, True, True),
                                      ("nvfp4", False, False, False), ("nvfp4", True, False, False),
                                      ("mxfp4", False, False, False)):
            blk = 16 if fmt == "nvfp4" else 32
            nbytes = (M * K * 2 + M * K // 2 + M * K // blk + (4 * M if fmt == "nvfp4" else 0) + (M * K // 8 if guide else 0)
                      + (M * K * 2 if fake else 0))
            fd = torch.bfloat16 if fake else None
            t = bench(lambda: quantize_rows(x, fmt, guidance=guide, fake_dtype=fd, check_finite=False, fma_rtn=fma))
            record("quantize", f"{M}x{K}", f"triton-{fmt}{'+guide' if guide else ''}{'+dequant' if fake else ''}"
                   f"{'' if fma else '-cmp'}", t, nbytes)
        if M * K <= 8192 * 4096 and not quick:
            t = bench(lambda: ref.nvfp4_quantize(x.float(), outer="row"))
            record("quantize", f"{M}x{K}", "torch-reference-nvfp4", t, M * K * 2 + M * K // 2 + M * K // 16 + 4 * M)


# MMA tiles timed around a config: (words per K-tile BKW, weight rows BN, warps, stages), the bf16 decode
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


def _fake_rows(t):
    """The engine's activation quantize above its crossover (EngineForward._act_fast): rows of t [..., K]
    through the quantize kernel, its dequantized copy back in t's shape."""
    return fake_rows(t.reshape(-1, t.shape[-1])).view(t.shape)


def w4a4_bf16_linear(x, wb):
    """The rollout engine's dense projection above its kernels' crossover (trace/rollout/fast.py): the
    quantize kernel's dequantized activation rows times the dequantized weight wb [N, K] on BF16 GEMMs."""
    return F.linear(_fake_rows(x), wb)


def w4a4_bf16_moe(x, ids, tw, w13, w2):
    """The rollout engine's routed experts above its kernels' crossover: its own code
    (trace/rollout/forward.py `routed_experts`, with the routing sort inside) on x [T, H], ids / tw [T, k],
    the dequantized weights w13 [E, 2I, H] (gate | up) and w2 [E, H, I]. -> [T, H]."""
    return routed_experts(x, ids.long(), tw, w13, w2, _fake_rows, _fake_rows)


def moe_tol(act_quant):
    """Relative error allowed against the oracle: W4A4's bf16 rounding of h flips a few FP4 codes of the down
    input."""
    return 6e-2 if act_quant else 2e-2


def run_moe(dev, quick):
    log("== grouped MoE FP4 (routed-expert MLP of one layer)")
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
        w13 = torch.cat([ref.nvfp4_dequantize(*g), ref.nvfp4_dequantize(*u)], 1).to(torch.bfloat16)
        w2 = ref.nvfp4_dequantize(*d).to(torch.bfloat16)
        e = relerr(w4a4_bf16_moe(x, ids, tw, w13, w2), ref.moe_fp4_reference(x.float(), g, u, d, ids, tw, act_quant=True))
        check(f"moe {fam} T{T} w4a4 on bf16 gemms", e < 6e-2, f"rel err {e:.2e} (tol 6e-2, bf16 h and output)")
        del g, u, d, mw, w13, w2
    tk = load_anchor()
    fams = STATE.get("families") or (["qwen3-30b-a3b", "mixtral-8x7b"] if quick else list(FAMILIES))
    for fam in fams:
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
            del r16
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


def run_sampling(dev, quick):
    """The rollout engine's per-step sampling at the Qwen3 vocabulary (151,936) over 64 and 256 rows of bf16 logits:
    its torch passes (`RolloutEngine._sample_torch`) against `kernels.sampling.fused_sample`, greedy and at
    temperature 1, eager (as the engine launches them: outside its CUDA graphs). Checks first: greedy tokens equal
    torch.argmax's, log-probs (greedy and sampled) within 1e-4 of float64 log_softmax."""
    from kernels.sampling import fused_sample
    from trace.rollout.engine import RolloutEngine

    log("== sampling (one decode step's logits -> tokens, log-probs, finite flag)")
    V = 151936
    for A in (64, 256):
        x = (torch.randn(A, V, device=dev) * 3).to(torch.bfloat16)
        shape = f"A{A} V{V}"
        tok, lp, _ = fused_sample(x, 0.0)
        want_tok, want_lp, _ = ref.sample_reference(x, 0.0)
        e = float((lp.double() - want_lp).abs().max())
        check(f"sampling greedy {shape}", torch.equal(tok, want_tok) and e < 1e-4, f"max |dlogp| {e:.1e}")
        tok, lp, _ = fused_sample(x, 1.0, seed=1)  # the log-probs of the sampled tokens (the tokens: the tests)
        e = float((lp.double() - torch.log_softmax(x.double(), -1).gather(-1, tok[:, None]).squeeze(-1)).abs().max())
        check(f"sampling t=1 {shape}", e < 1e-4, f"max |dlogp| {e:.1e}")
        gen = torch.Generator(device=dev)
        gen.manual_seed(0)
        for t, name in ((0.0, "greedy"), (1.0, "t1")):
            base = record("sampling", shape, f"torch-{name}", bench(lambda t=t, x=x: RolloutEngine._sample_torch(x, t, 1.0, gen),
                                                                   graph=False), x.numel() * 2)
            record("sampling", shape, f"fused-{name}", bench(lambda t=t, x=x: fused_sample(x, t, 7), graph=False),
                   x.numel() * 2, base_ms=base, config="block=4096;num_warps=8")
        del x


def run_fused(dev, quick):
    """The rollout engine's small fused ops at a Qwen3-30B-A3B decode step (256 and 64 rows; H 2048, 32 / 4 heads x
    128, 128 experts top-8): the torch ops of `trace/rollout/forward.py` (residual add + RMSNorm; per-head q/k RMSNorm +
    RoPE; the router's softmax + top-k + renormalisation) against `kernels.norm` / `kernels.routing`, in CUDA graphs as
    the engine replays them. Checks first: the residual sums and a RoPE without the norm bit-identical to torch's, the
    normed values within 3 bf16 roundings, the routing's experts torch's where no two probabilities are near-tied."""
    from kernels.norm import norm_rope, rms_norm
    from kernels.routing import topk_softmax
    from trace.rollout.forward import rms_norm as torch_rms_norm
    from trace.rollout.forward import rope

    log("== norms (residual add + RMSNorm, q/k norm + RoPE)")
    H, nh, nkv, D, eps, bf = 2048, 32, 4, 128, 1e-6, torch.bfloat16
    for R in (256, 64):
        x, r = (torch.randn(R, H, device=dev) * 4).to(bf), torch.randn(R, H, device=dev).to(bf)
        w = (1 + 0.3 * torch.randn(H, device=dev)).to(bf)
        s, y = rms_norm(x, w, eps, residual=r)
        want = torch_rms_norm(x + r, w, eps)
        e = float(((y.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)).max())
        check(f"add+rmsnorm R{R}", torch.equal(s, x + r) and e <= 3 * 2 ** -7, f"sum exact; max rel {e:.1e}")

        def torch_add_norm(x=x, r=r, w=w):
            t = x + r
            return t, torch_rms_norm(t, w, eps)

        shape = f"R{R} H{H}"
        nbytes = 4 * R * H * 2  # x, residual in; sum, norm out
        base = record("norm", shape, "torch-add+rmsnorm", bench(torch_add_norm), nbytes)
        record("norm", shape, "fused-add+rmsnorm", bench(lambda x=x, r=r, w=w: rms_norm(x, w, eps, residual=r)), nbytes,
               base_ms=base)
        pos = torch.randint(0, 4096, (R,), device=dev).float()
        inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
        emb = torch.cat([pos[:, None] * inv] * 2, -1)
        c, sn = emb.cos().to(bf), emb.sin().to(bf)
        q, k = torch.randn(R, nh, D, device=dev).to(bf), torch.randn(R, nkv, D, device=dev).to(bf)
        qw, kw = (1 + 0.3 * torch.randn(D, device=dev)).to(bf), (1 + 0.3 * torch.randn(D, device=dev)).to(bf)

        def torch_rope(t, wt):
            return rope(torch_rms_norm(t, wt, eps), c, sn)

        check(f"rope R{R}", torch.equal(norm_rope(q, c, sn), rope(q, c, sn)), "bit-identical without the norm")
        shape = f"R{R} q{nh} k{nkv} x{D}"
        nbytes = 2 * R * (nh + nkv) * D * 2
        base = record("norm", shape, "torch-qk-norm+rope", bench(lambda: (torch_rope(q, qw), torch_rope(k, kw))), nbytes)
        record("norm", shape, "fused-qk-norm+rope", bench(lambda: (norm_rope(q, c, sn, qw, eps), norm_rope(k, c, sn, kw, eps))),
               nbytes, base_ms=base)
        E, k = 128, 8
        logits = torch.randn(R, E, device=dev).to(bf)

        def torch_route():
            v, i = torch.topk(torch.softmax(logits.float(), -1), k, dim=-1)
            return (v / v.sum(-1, keepdim=True)).to(bf), i

        (v, i), (wv, wi) = topk_softmax(logits, k, True, bf), torch_route()
        p = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
        clear = ((p[:, :k] - p[:, 1:k + 1]) > 1e-5 * p[:, :k]).all(-1)  # rows with no near-tie in their top k + 1
        same = bool((i == wi).all(-1)[clear].all()) and bool(((v.float() - wv.float()).abs() <= 2 ** -7 * wv.float().abs()).all(-1)[clear].all())
        check(f"routing R{R}", same, f"experts and weights torch's on {int(clear.sum())} of {R} rows without a near-tie")
        shape, nbytes = f"R{R} E{E} top{k}", R * E * 2
        base = record("routing", shape, "torch-softmax+topk+renorm", bench(torch_route), nbytes)
        record("routing", shape, "fused-topk-softmax", bench(lambda: topk_softmax(logits, k, True, bf)), nbytes, base_ms=base)


def _sweep(provider, shape, variants, want, base):
    """Time each (config, fn) attention variant whose output is `want`'s (rel. err < 1e-2, a check row each) as sweep
    rows -> the fastest (times, config), or None."""
    best = None
    for cs, fn in variants:
        try:
            err = relerr(fn(), want)  # a timed variant must compute what the checked default does
            if not check(f"attention {provider} {cs} vs the checked default {shape}", err < 1e-2, f"rel err {err:.2e}"):
                continue
            t = bench(fn)
        except Exception as ex:
            log(f"  {provider} variant {cs} failed: {type(ex).__name__}: {str(ex)[:300]}")
            continue
        sweep_row("attention", shape, provider, t, base, cs)
        if best is None or t[0] < best[0][0]:
            best = (t, cs)
    return best


def run_attention(dev, quick):
    log("== FP4-KV decode attention")
    Hq, Hkv, D = 32, 4, 128
    # correctness: variable lengths (incl. 0 and non-multiples of the tile), fresh data
    B, L = 6, 3000
    lens = torch.tensor([3000, 1, 0, 777, 2048, 65], device=dev)
    starts = torch.arange(B, device=dev) * L
    cache = FP4KVCache.allocate(B * L, Hkv, D, dev)
    k = torch.randn(B * L, Hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B * L, Hkv, D, device=dev, dtype=torch.bfloat16)
    kv_store(cache, k, v, torch.arange(B * L, device=dev))
    c, s, o = ref.nvfp4_quantize(k.float().cpu(), outer="row")  # CPU oracle (see NOTES.md)
    check("kv_store bit-exact", torch.equal(cache.k_packed.cpu(), ref.pack_fp4(c)) and torch.equal(cache.k_scales.cpu(), s)
          and torch.equal(cache.k_outer.cpu(), o.squeeze(-1)), "K codes, scales, outer")
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
    out = decode_attention(q, cache, starts, lens, L)
    kh = ref.kv_dequantize(cache.k_packed, cache.k_scales, cache.k_outer).view(B, L, Hkv, D)
    vh = ref.kv_dequantize(cache.v_packed, cache.v_scales, cache.v_outer).view(B, L, Hkv, D)
    r = ref.decode_attention_reference(q.float(), kh, vh, lens)
    e = relerr(out, r)
    check("decode attention varlen", e < 2e-2, f"rel err {e:.2e} (tol 2e-2, bf16 P and output)")
    del cache, k, v, kh, vh
    # (sequences, context): the 64 x 8k target, and the engine's own decode at batch 256 and its mean context in the
    # 1k-generation run (512-token prompts)
    shapes = [(64, 8192), (256, 1024)] if quick else [(64, 1024), (64, 4096), (64, 8192), (64, 16384), (256, 1024)]
    for B, L in shapes:
        shape = f"B{B} L{L} Hq{Hq} Hkv{Hkv} D{D}"
        kb = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16)
        vb = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16)
        q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
        q4 = q.unsqueeze(2)
        base = record("attention", shape, "bf16-sdpa",
                      bench(lambda: F.scaled_dot_product_attention(q4, kb, vb, enable_gqa=True)),
                      B * L * Hkv * D * 2 * 2 + 2 * B * Hq * D * 2)
        cache = FP4KVCache.allocate(B * L, Hkv, D, dev)
        kv_store(cache, kb.transpose(1, 2).reshape(B * L, Hkv, D), vb.transpose(1, 2).reshape(B * L, Hkv, D),
                 torch.arange(B * L, device=dev))
        starts = torch.arange(B, device=dev, dtype=torch.int32) * L
        lens = torch.full((B,), L, device=dev, dtype=torch.int32)
        ref_o = F.scaled_dot_product_attention(q4, kb, vb, enable_gqa=True).squeeze(2)
        # the BF16 engine's own decode call (trace/rollout/forward.py: each KV head's G query rows over its K/V with
        # the rows' length mask; 275 us per layer inside the engine at B256 x ~1.2k, v5h) and the same mask through
        # enable_gqa: which BF16 formulation the engine's baseline should take
        keep = torch.ones(B, 1, 1, L, dtype=torch.bool, device=dev)
        qg = q.view(B, Hkv, Hq // Hkv, D)
        # the engine's cache is [B, Hkv, cap + 1, D] and its decode reads the view [:, :, :S] (row stride > S * D)
        kcap = torch.zeros(B, Hkv, L + 257, D, device=dev, dtype=torch.bfloat16)
        vcap = torch.zeros_like(kcap)
        kcap[:, :, :L], vcap[:, :, :L] = kb, vb
        kv_, vv_ = kcap[:, :, :L], vcap[:, :, :L]
        for name, fn in (("bf16-sdpa-engine-rows", lambda: F.scaled_dot_product_attention(qg, kb, vb, attn_mask=keep)),
                         ("bf16-sdpa-engine-view", lambda: F.scaled_dot_product_attention(qg, kv_, vv_, attn_mask=keep)),
                         ("bf16-sdpa-gqa-view", lambda: F.scaled_dot_product_attention(q4, kv_, vv_, enable_gqa=True)),
                         ("bf16-sdpa-masked-gqa", lambda: F.scaled_dot_product_attention(q4, kb, vb, attn_mask=keep,
                                                                                         enable_gqa=True))):
            err = relerr(fn().reshape(B, Hq, D), ref_o)
            if check(f"attention {name} vs bf16 sdpa {shape}", err < 1e-2, f"rel err {err:.2e}"):
                sweep_row("attention", shape, name, bench(fn), base, "mask=[B,1,1,L]" if "gqa-view" not in name else "no mask")
        out = decode_attention(q, cache, starts, lens, L)
        check(f"attention vs bf16 sdpa {shape}", relerr(out, ref_o) < 0.15,
              f"rel err {relerr(out, ref_o):.2e} (includes FP4 KV quantization error)")
        nbytes = B * L * cache.nbytes_per_token() + 2 * B * Hq * D * 2
        # tiles, warps, context splits (auto: one once B x Hkv fills the SMs; 2 was the old default at B64), the
        # K/V loads' cp.async stages (Triton's default 3; 1: plain loads) and register caps (the compiler's ~154 per
        # thread leave 3 programs per SM, 12 warps, latency-bound: kernels/NOTES.md v4b ncu; 128 fit 4, 96 fit 5)
        variants = []
        for bn, w, sp, ns, nr in [(64, 4, None, None, None), (32, 4, None, None, None), (64, 8, None, None, None),
                                  (128, 8, None, None, None), (64, 4, 2, None, None), (64, 4, 4, None, None),
                                  (64, 4, None, 1, None), (64, 4, None, 2, None), (64, 4, None, 4, None),
                                  (64, 4, None, None, 128), (64, 4, None, None, 96), (32, 4, None, None, 96)]:
            cs = f"block_n={bn};num_warps={w};splits={sp or 'auto'};stages={ns or 'default'};maxnreg={nr or 'default'}"
            variants.append((cs, lambda bn=bn, w=w, sp=sp, ns=ns, nr=nr: decode_attention(
                q, cache, starts, lens, L, block_n=bn, num_warps=w, num_splits=sp, num_stages=ns, maxnreg=nr,
                check_finite=False)))
        best = _sweep("fp4kv-triton", shape, variants, out, base)
        record("attention", shape, "fp4kv-triton", best[0], nbytes, base, config=best[1])
        # the register-operand kernel (kernels/attention_mma.py: one warp per (sequence, KV head, split), mma.sync on
        # the decoded K/V fragments): its default split, a sweep, the next step's loads first, 16 keys a step (v5j's
        # default), a register cap
        from kernels.attention_mma import decode_attention_mma, default_splits
        variants = [(f"splits={sp or default_splits(B, Hkv, L, q.device)}{'' if sp else ' (default)'};{kv}",
                     lambda sp=sp, kv=kv: decode_attention_mma(q, cache, starts, lens, L, num_splits=sp,
                                                               check_finite=False, **kv))
                    for sp, kv in ((None, {}), (1, {}), (2, {}), (4, {}), (8, {}), (None, {"prefetch": True}),
                                   (None, {"keys_per_step": 16}), (None, {"maxnreg": 128}), (2, {"maxnreg": 128}))]
        best = _sweep("fp4kv-mma", shape, variants, out, base)
        if best is not None:
            record("attention", shape, "fp4kv-mma", best[0], nbytes, base, config=best[1])
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# Offline SASS (no GPU needed: Triton compiles for sm_90 with its bundled ptxas; cuobjdump disassembles):
# the main loop's instructions per weight of the v1 GEMV kernel and of the MoE and dense MMA kernels (the v3a tile).
# sm_90's ALU pipe (integer and logic ops, compares, selects, min/max, byte permutes) takes 16 lanes per clock
# per SM sub-partition, half the issue rate, so a kernel made mostly of them is bound by their count at 2 cycles
# per warp instruction (kernels/NOTES.md, quantize: the pipe model); FFMA/FMUL/FADD/IMAD go to the FMA pipes.
SASS_ALU_OPS = {"LOP3", "SHF", "IADD3", "SEL", "FSEL", "FSETP", "ISETP", "PRMT", "FMNMX", "IMNMX", "VIMNMX", "SGXT",
                "LEA", "MOV", "P2R", "R2P", "PLOP3", "BMSK", "FLO", "POPC", "BREV", "VIADD", "IABS", "I2FP", "F2FP"}


def _loop_sass(fn, sig, aligned, constexprs, num_warps, num_stages, name, whole=False, gluon=False):
    """Compile fn for sm_90 -> (instructions of the loop (the span of the last backward branch; of the longest for
    a Gluon kernel, whose epilogue may loop; with whole, of the kernel), op counts, TTGIR convert_layout count,
    shared bytes). gluon: fn is a Gluon kernel (its layouts and pipelining are in the source: no num_stages)."""
    import glob
    from collections import Counter

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bindir = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin"))[0]
    attrs = {(list(sig).index(k),): [["tt.divisibility", 16]] for k in aligned}
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        src, opts = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), dict(num_warps=num_warps)
    else:
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        opts = dict(num_warps=num_warps, num_stages=num_stages)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    path = f"/tmp/{name}.cubin"
    with open(path, "wb") as f:
        f.write(ck.asm["cubin"])
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    body = [x for _, x in ins] if whole else []
    # out-of-line code after the kernel's last unpredicated EXIT (mbarrier try-wait retries of TMA loads) branches back
    # into the loop: not a loop of its own
    end = max((a for a, t in ins if t == "EXIT"), default=ins[-1][0] if ins else 0)
    if not whole:
        for a, t in ins:
            if a > end:
                break
            tg = re.search(r"BRA\s+0x([0-9a-f]+)", t)
            if tg and int(tg.group(1), 16) < a:
                span = [x for b, x in ins if int(tg.group(1), 16) <= b <= a]
                body = max(body, span, key=len) if gluon else span
    # memory and barrier instructions keep their width suffix (LDG.E.128 against STG.E.U8), the rest are grouped
    ops = Counter(op if op.startswith(("LDG", "STG", "LDS", "STS", "BAR")) else op.split(".")[0]
                  for op in (re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for x in body))
    return len(body), ops, ck.asm["ttgir"].count("convert_layout"), ck.metadata.shared


def _mem_ops(ops, prefixes=("LDG", "UTMA", "SYNCS", "LDS", "STS")) -> str:
    """The memory and barrier instructions of a SASS op count, `name:count` sorted (a `_sass_row` stat)."""
    return " ".join(f"{k}:{v}" for k, v in sorted(ops.items()) if k.startswith(prefixes))


def _sass_row(rows, shape, provider, config, ops, **stats):
    """One offline SASS row (the loop's stats and its 8 most frequent instructions in `note`), appended and logged."""
    stats["top_ops"] = " ".join(f"{k}:{v}" for k, v in ops.most_common(8))
    rows.append(dict(op="sass", shape=shape, provider=provider, config=config,
                     note=";".join(f"{k}={v}" for k, v in stats.items())))
    log(rows[-1])


def sass_counts():
    from kernels.gemm import _fp4_gemm_kernel, _fp4_gemv2_kernel
    from kernels.moe import _moe_gemm_kernel

    rows = []
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "wf_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32",
           "K": "i32", "G": "i32", "stride_xm": "i32", "g_per_split": "i32", "BN": "constexpr", "BM": "constexpr",
           "U": "constexpr", "SPLIT": "constexpr", "NIT": "constexpr", "EVEN": "constexpr", "PREFETCH": "constexpr"}
    aligned = ["x_ptr", "w_ptr", "s_ptr", "wf_ptr", "out_ptr", "N", "K", "stride_xm"]
    for bn, bm, u, nw, pf in [(32, 1, 2, 4, False), (64, 1, 2, 4, False), (16, 1, 2, 4, False), (32, 2, 2, 4, False),
                              (32, 4, 2, 4, False), (64, 4, 2, 4, False), (32, 1, 1, 4, True)]:
        cst = dict(BN=bn, BM=bm, U=u, SPLIT=1, NIT=16 // u, EVEN=not pf, PREFETCH=pf)  # K=4096: 16 groups
        n, ops, cvt, _ = _loop_sass(_fp4_gemv2_kernel, sig, aligned, cst, nw, 1, f"gemv2_{bn}_{bm}_{u}_{nw}_{int(pf)}")
        wpt = (bn // (4 * nw)) * 32 * u  # weights per thread per iteration (rows/thread * 32 * U)
        _sass_row(rows, "K4096", "_fp4_gemv2_kernel", f"BN={bn};BM={bm};U={u};num_warps={nw};prefetch={pf}", ops,
                  ttgir_convert_layouts=cvt, loop_instr=n, weights_per_thread_iter=wpt,
                  instr_per_weight=round(n / wpt, 3), instr_per_weight_row=round(n / wpt / bm, 3))
    # MoE gate/up MMA kernel (GATED), K 2048, BN 64, BKW 16, 4 warps: the v3a tile (kernels/NOTES.md v3a: one dot
    # per K-tile), decoding in fp32 and in bf16 (BF16D: inline PTX, the weight words in pair_layout); A: bf16
    # (W4A16) or dec (W4A4: the tile values its quantize pass writes, times the row's 2^7 / S_enc after the MMA)
    moe_sig = {"x_ptr": "*bf16", "xf_ptr": "*bf16", "w_ptr": "*i32", "ws_ptr": "*u8", "wf_ptr": "*fp32",
               "out_ptr": "*bf16", "slots_ptr": "*i32", "bexp_ptr": "*i32", "rw_ptr": "*fp32", "S": "i32", "N": "i32",
               "KW": "i32", "stride_xm": "i32", "A_DIV": "i32", "BM": "constexpr", "BN": "constexpr",
               "BKW": "constexpr", "GATED": "constexpr", "ROUTE_W": "constexpr", "INTERP": "constexpr",
               "NIT": "constexpr", "BF16D": "constexpr", "XF": "constexpr"}
    moe_aligned = ["x_ptr", "w_ptr", "ws_ptr", "out_ptr", "N", "KW", "stride_xm", "slots_ptr"]
    for mode in ("bf16", "dec"):
        sig = dict(moe_sig, xf_ptr="*bf16" if mode == "bf16" else "*fp32")
        for tile, bkw, st, bf in [("v3a", 16, 3, False), ("v3a-bf16", 16, 3, True)]:
            for bm in (16, 64):
                cst = dict(BM=bm, BN=64, BKW=bkw, GATED=True, ROUTE_W=False, INTERP=False,
                           NIT=256 // bkw, BF16D=bf, XF=mode != "bf16")
                n, ops, cvt, shared = _loop_sass(_moe_gemm_kernel, sig, moe_aligned, cst, 4, st,
                                                 f"moe_{tile}_{mode}_{bm}")
                w_iter = 64 * 8 * bkw * 2  # weight elements per loop iteration (gate and up)
                _sass_row(rows, "K2048 gate+up", f"_moe_gemm_kernel {tile}",
                          f"A={mode};BM={bm};BN=64;BKW={bkw};num_warps=4;num_stages={st}", ops, loop_instr=n,
                          lane_instr_per_weight=round(n * 128 / w_iter, 2), shared_bytes=shared,
                          ttgir_convert_layouts=cvt)
    # dense MMA kernel, the default tile at 14336x4096, M 16: BM 16, BN 64, BKW 16, split-K 4 (FP32 atomics), 4 warps,
    # 3 stages, the bf16 decode; A as above. kw_per_split is divisible by 16 at every launch (a multiple of BKW), which
    # Triton's JIT specializes on, so the offline compile says so too
    dense_sig = {"x_ptr": "*bf16", "xf_ptr": "*bf16", "w_ptr": "*i32", "ws_ptr": "*u8", "wf_ptr": "*fp32",
                 "out_ptr": "*fp32", "M": "i32", "N": "i32", "KW": "i32", "stride_xm": "i32", "kw_per_split": "i32",
                 "BM": "constexpr", "BN": "constexpr", "BKW": "constexpr", "SPLIT": "constexpr", "INTERP": "constexpr",
                 "NIT": "constexpr", "BF16D": "constexpr", "XF": "constexpr"}
    dense_aligned = ["x_ptr", "w_ptr", "ws_ptr", "out_ptr", "N", "KW", "stride_xm", "kw_per_split"]
    for mode in ("bf16", "dec"):
        sig = dict(dense_sig, xf_ptr="*bf16" if mode == "bf16" else "*fp32")
        cst = dict(BM=16, BN=64, BKW=16, SPLIT=4, INTERP=False, NIT=8, BF16D=True, XF=mode != "bf16")
        n, ops, cvt, shared = _loop_sass(_fp4_gemm_kernel, sig, dense_aligned, cst, 4, 3, f"dense_v3a-bf16_{mode}")
        _sass_row(rows, "K4096 split4", "_fp4_gemm_kernel v3a-bf16", f"A={mode};BM=16;BN=64;BKW=16;num_warps=4;num_stages=3",
                  ops, loop_instr=n, lane_instr_per_weight=round(n * 128 / (64 * 8 * 16), 2), shared_bytes=shared,
                  ttgir_convert_layouts=cvt)
    # v5a: both tiles (W4A16, bf16 decode, BM 16) with the weight words and scales by TMA (`tma=True`; BKW 32 for
    # 16-byte scale rows), and the pointer tiles at BKW 32 beside them
    for fn, sig, aligned, cst, shape, w_iter in (
            (_moe_gemm_kernel, moe_sig, moe_aligned, dict(GATED=True, ROUTE_W=False, NIT=8), "K2048 gate+up", 2),
            (_fp4_gemm_kernel, dense_sig, dense_aligned, dict(SPLIT=4, NIT=4), "K4096 split4", 1)):
        for tma in (False, True):
            s_tma = dict(sig, WDESC="constexpr")
            if tma:
                s_tma.update(w_ptr="tensordesc<i32[64, 32]>", ws_ptr="tensordesc<u8[64, 16]>")
            n, ops, cvt, shared = _loop_sass(
                fn, s_tma, [a for a in aligned if not (tma and a in ("w_ptr", "ws_ptr"))],
                dict(cst, BM=16, BN=64, BKW=32, INTERP=False, BF16D=True, XF=False, WDESC=tma), 4, 3,
                f"{fn.__name__}_v5a_{int(tma)}")
            _sass_row(rows, shape, f"{fn.__name__} {'v5a-tma' if tma else 'v3a-bf16'}",
                      "A=bf16;BM=16;BN=64;BKW=32;num_warps=4;num_stages=3", ops, loop_instr=n,
                      lane_instr_per_weight=round(n * 128 / (64 * 8 * 32 * w_iter), 2), shared_bytes=shared,
                      ttgir_convert_layouts=cvt, memory_ops=_mem_ops(ops))
    # v5k: both tiles (W4A16, bf16 decode, K-tiles of 128) with the weights in the dot order (int32 scale words) beside
    # the pair order: the decoded tile's shared-memory trip (STS, LDSM, barriers) gone
    for fn, sig, aligned, cst, shape, w_iter in (
            (_moe_gemm_kernel, moe_sig, moe_aligned, dict(GATED=True, ROUTE_W=False, NIT=16), "K2048 gate+up", 2),
            (_fp4_gemm_kernel, dense_sig, dense_aligned, dict(SPLIT=4, NIT=8, KMASK=False), "K4096 split4", 1)):
        for bm in (16, 32):
            for dot in (False, True):
                s_dot = dict(sig, WDESC="constexpr", DOT="constexpr", ws_ptr="*i32" if dot else "*u8",
                             **({"KMASK": "constexpr"} if "KMASK" in cst else {}))
                c = dict(cst, BM=bm, BN=64, BKW=16, INTERP=False, BF16D=True, XF=False, WDESC=False, DOT=dot)
                if "KMASK" in c:
                    c["KMASK"] = not dot
                n, ops, cvt, shared = _loop_sass(fn, s_dot, aligned, c, 4, 3, f"{fn.__name__}_v5k_{bm}_{int(dot)}")
                _sass_row(rows, shape, f"{fn.__name__} {'v5k-dot' if dot else 'v3a-bf16'}",
                          f"A=bf16;BM={bm};BN=64;BKW=16;num_warps=4;num_stages=3", ops, loop_instr=n,
                          lane_instr_per_weight=round(n * 128 / (64 * 8 * 16 * w_iter), 2), shared_bytes=shared,
                          ttgir_convert_layouts=cvt, memory_ops=_mem_ops(ops))
    # FP4-KV decode attention, D 128, 8 query heads per KV head (16 MMA rows), 64-token tiles, 4 warps (the
    # engine's default tile): loop instructions per K/V element (kernels/NOTES.md v2i, v3b)
    from kernels.attention import _decode_attn_kernel
    sig = {"q_ptr": "*bf16", "kp_ptr": "*i32", "ks_ptr": "*u8", "kf_ptr": "*fp32", "vp_ptr": "*i32",
           "vs_ptr": "*u8", "vf_ptr": "*fp32", "starts_ptr": "*i32", "lens_ptr": "*i32", "o_ptr": "*fp32",
           "lse_ptr": "*fp32", "qk_scale": "fp32", "Hq": "i32", "Hkv": "i32", "per_split": "i32", "NSPLIT": "i32",
           "G": "constexpr", "GP": "constexpr", "D": "constexpr", "BLOCK_N": "constexpr", "NIT": "constexpr",
           "INTERP": "constexpr", "DIRECT": "constexpr"}
    aligned = ["q_ptr", "kp_ptr", "ks_ptr", "kf_ptr", "vp_ptr", "vs_ptr", "vf_ptr", "o_ptr", "lse_ptr"]
    for bn in (32, 64, 128):
        cst = dict(G=8, GP=16, D=128, BLOCK_N=bn, NIT=8192 // bn, INTERP=False, DIRECT=False)
        n, ops, cvt, shared = _loop_sass(_decode_attn_kernel, sig, aligned, cst, 4, 1, f"attn_{bn}")
        _sass_row(rows, "D128 G8", "_decode_attn_kernel", f"BLOCK_N={bn};num_warps=4", ops, loop_instr=n,
                  lane_instr_per_kv_element=round(n * 128 / (2 * bn * 128), 2), shared_bytes=shared,
                  ttgir_convert_layouts=cvt)
    # the register-operand kernel (kernels/attention_mma.py, Gluon; one warp per program): per loop step of 16 or 32
    # keys a thread holds 2 keys x 32 elements of K and of V (v5j, v5k), registers bound the programs per SM
    from kernels.attention_mma import _decode_attn_mma_kernel
    sig = {"q_ptr": "*bf16", "kp_ptr": "*i32", "ks_ptr": "*u8", "kf_ptr": "*fp32", "vp_ptr": "*i32", "vs_ptr": "*u8",
           "vf_ptr": "*fp32", "starts_ptr": "*i32", "lens_ptr": "*i32", "o_ptr": "*bf16", "lse_ptr": "*bf16",
           "qk_scale": "fp32", "Hq": "i32", "Hkv": "i32", "per_split": "i32", "NSPLIT": "i32"}
    for keys in (16, 32):
        name = f"attn_mma_{keys}"
        n, ops, _, shared = _loop_sass(_decode_attn_mma_kernel, sig, [k for k in sig if sig[k].startswith("*")],
                                       dict(G=8, GP=8, T=keys, PREFETCH=False, DIRECT=True), 1, 1, name, gluon=True)
        res = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"),
                              "-res-usage", f"/tmp/{name}.cubin"], capture_output=True, text=True).stdout
        _sass_row(rows, "D128 G8", "_decode_attn_mma_kernel", f"keys_per_step={keys};num_warps=1", ops, loop_instr=n,
                  lane_instr_per_kv_element=round(n / (2 * keys * 128 / 32), 2), shared_bytes=shared,
                  registers=int(re.search(r"REG:(\d+)", res).group(1)))
    # activation quantize, one row of 4096 per program (the GPU's tile at 8192x4096), bf16 in, RTN, codes and scales
    # out: whole-kernel instructions per element and the widths of its loads and stores (kernels/NOTES.md, quantize)
    from kernels.quantize import _quant_rows_kernel
    sig = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*u8", "outer_ptr": "*fp32", "mbits_ptr": "*u8",
           "dst_ptr": "*u8", "fq_ptr": "*bf16", "M": "i32", "K": "i32", "stride_xm": "i32", "seed": "i32",
           "amax_min": "fp32"}
    aligned = ["x_ptr", "codes_ptr", "scales_ptr", "outer_ptr", "mbits_ptr", "fq_ptr", "K", "stride_xm"]
    for fmt, block, fma in (("nvfp4", 16, False), ("mxfp4", 32, False), ("nvfp4", 16, True), ("mxfp4", 32, True)):
        cst = dict(BM=1, NB=4096 // block, BLOCK=block, IS_NV=fmt == "nvfp4", NOCLIP=False, STOCH=False, GUIDE=False,
                   FAKE=False, FAKE_EXACT=False, FAKE_TILE=False, HAS_DST=False, SINGLE=True, CH=4096, NCH=1,
                   INTERP=False, GIVEN=False, FMA_RTN=fma)
        sig.update({k: "constexpr" for k in cst})
        n, ops, cvt, shared = _loop_sass(_quant_rows_kernel, sig, aligned, cst, 4, 1, f"quant_{fmt}_{int(fma)}",
                                         whole=True)
        alu = sum(v for k, v in ops.items() if k in SASS_ALU_OPS)
        # us for 8192 rows x 4 warps at c clocks per row-warp on 132 SMs x 4 sub-partitions at 1.98 GHz
        bound_us = lambda c: round(8192 * 4 * c / (132 * 4 * 1.98e9) * 1e6, 1)  # noqa: E731
        _sass_row(rows, "8192x4096", f"_quant_rows_kernel {fmt}{'' if fma else '-cmp'}",
                  "BM=1;CH=4096;num_warps=4", ops, kernel_instr=n,
                  instr_per_element=round(n * 128 / 4096, 2), shared_bytes=shared, ttgir_convert_layouts=cvt,
                  memory_ops=_mem_ops(ops, ("LDG", "STG", "BAR")), alu_ops=alu,
                  alu_bound_us=bound_us(2 * alu), issue_bound_us=bound_us(n))
    # the engine's sampling pass (kernels/sampling.py): 4096 logits per loop step over 8 warps (16 per thread); the
    # stride and vocabulary divisible by 16 as at 151,936, as the runtime specializes them
    from kernels.sampling import _sample_kernel

    sig = {"x_ptr": "*bf16", "stride": "i32", "V": "i32", "V4": "i32", "inv_t": "fp32", "seed": "i64",
           "tok_ptr": "*i64", "lp_ptr": "*fp32", "bad_ptr": "*i32", "GREEDY": "constexpr", "ASM": "constexpr",
           "BLOCK": "constexpr"}
    for greedy in (True, False):
        n, ops, _, _ = _loop_sass(_sample_kernel, sig, ["x_ptr", "stride", "V", "V4"],
                                  dict(GREEDY=greedy, ASM=True, BLOCK=4096), 8, 1, f"sample_{int(greedy)}")
        _sass_row(rows, "V 151936", "_sample_kernel", f"{'greedy' if greedy else 'temperature'};BLOCK=4096;num_warps=8",
                  ops, loop_instr=n, instr_per_logit=round(n / 16, 2))
    RUN.update(gpu="sm_90 (offline ptxas)")
    for r in rows:
        _emit(r)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/kernels/kernels.csv", help="long table to append to")
    ap.add_argument("--version", default="dev", help="the kernel version under test (a column of every row)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time tile-config variants of ours")
    ap.add_argument("--only", default="quantize,dense,moe,attention,sampling,fused")
    ap.add_argument("--T", type=int, nargs="+", help=f"MoE tokens per layer (default {MOE_T}; --quick: 1 16 256)")
    ap.add_argument("--M", type=int, nargs="+", help=f"dense rows (default {DENSE_M}; --quick: 1 16 64)")
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES),
                    help="MoE shapes to check and time (default: all; --quick: Qwen3 and Mixtral)")
    ap.add_argument("--sass", action="store_true",
                    help="offline: append SASS instruction counts (v1 GEMV, MoE and dense MMA tile, KV decode attention, "
                         "quantize, the v4 Gluon kernels) "
                         "and exit")
    args = ap.parse_args(argv)
    STATE.update(out=args.out, sweep=args.sweep, T=args.T, M=args.M, families=args.families)
    RUN.update(version=args.version, commit=git_commit(), date=today())
    if args.sass:
        return sass_counts()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    dev = torch.device("cuda")
    RUN["gpu"] = torch.cuda.get_device_name(dev)
    torch.manual_seed(int(time.time()))  # fresh random data every run
    log(f"GPU {RUN['gpu']}, torch {torch.__version__}, triton {triton.__version__}, commit {RUN['commit']}")
    log(f"copy bandwidth (read+write) {bench_copy(dev):.0f} GB/s")
    t0 = time.time()
    for part in args.only.split(","):
        try:
            {"quantize": run_quantize, "dense": run_dense, "moe": run_moe, "attention": run_attention,
             "sampling": run_sampling, "fused": run_fused}[part](dev, args.quick)
        except Exception:
            log(f"!! {part} failed:\n{traceback.format_exc()}")
            note(part, f"failed: {traceback.format_exc()[-300:]}")
        log(f"   [{part} done at {time.time() - t0:.0f}s]")
    log("\n== summary (medians; ratio = baseline time / this time)")
    for r in ROWS:
        if r["op"] in ("dense", "moe", "attention", "quantize", "dense-part", "moe-part", "sampling", "norm", "routing"):
            log(f"{r['op']:9s} {r['shape']:30s} {r['provider']:24s} {r['median_us']:9.1f} us {r['pct_copy_bw']!s:>5}% "
                f"x{r['ratio_vs_bf16']!s:>6} bf16 x{r['ratio_vs_anchor']!s:>6} anchor")
    nfail = sum(r.get("ok") is False for r in ROWS)  # notes carry no ok
    log(f"checks: {sum(r.get('ok') is True for r in ROWS)} ok, {nfail} failed; appended {len(ROWS)} rows to {args.out}")


if __name__ == "__main__":
    main()
