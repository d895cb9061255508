"""GPU benchmark of the FP4 Triton kernels against PyTorch BF16, in one invocation.

What: (1) measures the copy-bandwidth ceiling; (2) checks every kernel on the GPU against
`kernels/reference.py` on fresh random data (bit-exact codes/scales for quantize; relative error for
GEMM / MoE / attention); (3) times each kernel and its PyTorch BF16 counterpart (cuBLAS `F.linear`,
`torch._grouped_mm`, SDPA) at the real layer shapes of the four model families; (4) writes a
long-format CSV (op, shape, provider, median_ms, p20_ms, p80_ms, tb_per_s, speedup_vs_bf16, gpu,
commit, config) and prints a summary.

Timing: every provider is captured in a CUDA graph (so Python launch overhead is excluded for both
sides) and replayed under `triton.testing.do_bench` (L2 flushed before every replay; median, p20,
p80 of the replays). MoE: routing (top-k, sort/pad by expert) is precomputed and shared by both
providers; the BF16 side times grouped_mm(gate_up) + silu*mul + grouped_mm(down) on expert-sorted
rows, the FP4 side its two kernels + the top-k sum. tb_per_s counts the minimal bytes: weights of the
experts actually hit (or the KV cache) read once, activations read once, outputs written once.

Run (repo root, on a GPU): `PYTHONPATH=. python benchmarks/bench_kernels.py --out results/kernels/kernels.csv`
(`--quick` for a subset). v1 decode kernels only (each variant checked against the oracle, then timed):
`--only dense_v1,moe_v1 --out results/kernels/kernels_v1.csv`. Plot: `python figures/plot_kernels.py`.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton

from kernels import reference as ref
from kernels.attention import FP4KVCache, decode_attention, kv_store
from kernels.gemm import GemmConfig, default_config, fp4_linear, prepare_weight
from kernels.moe import MoEConfig, default_moe_config, fused_moe, moe_align, prepare_moe_weights
from kernels.quantize import quantize_rows

FAMILIES = {  # name: (H, I, E, topk, shared-expert I or 0)
    "qwen3-30b-a3b": (2048, 768, 128, 8, 0),
    "mixtral-8x7b": (4096, 14336, 8, 2, 0),
    "olmoe-1b-7b": (2048, 1024, 64, 8, 0),
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4, 5632),
}
ROWS: list[dict] = []
CHECKS: list[dict] = []
GPU = "cpu"
COMMIT = "unknown"
OUT_PATH = None


def log(*a):
    print(*a, flush=True)


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


def record(op, shape, provider, t, nbytes, base_ms=None, config=""):
    med, p20, p80 = t
    row = dict(op=op, shape=shape, provider=provider, median_ms=round(med, 5), p20_ms=round(p20, 5),
               p80_ms=round(p80, 5), tb_per_s=round(nbytes / (med * 1e-3) / 1e12, 4) if nbytes else "",
               speedup_vs_bf16=round(base_ms / med, 3) if base_ms else "", gpu=GPU, commit=COMMIT, config=config)
    ROWS.append(row)
    if OUT_PATH:
        write(OUT_PATH)
    log(f"  {op:10s} {shape:38s} {provider:22s} {med*1e3:9.1f} us  {row['tb_per_s']!s:>7} TB/s  x{row['speedup_vs_bf16']!s:>6} {config}")
    return med


def check(name, ok, detail):
    CHECKS.append(dict(check=name, ok=bool(ok), detail=detail))
    log(f"  CHECK {'ok  ' if ok else 'FAIL'} {name}: {detail}")


def relerr(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def nv_weight(shape, dev, outer="tensor"):
    w = torch.randn(*shape, device=dev) * 0.02
    c, s, o = ref.nvfp4_quantize(w, outer=outer)
    return c, s, o


# ------------------------------------------------------------------------------------------------
def bench_copy(dev):
    n = 1 << 29  # 1 GiB of bytes (bf16 512M elements)
    a = torch.empty(n // 2, dtype=torch.bfloat16, device=dev).normal_()
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a), graph=False)
    bw = record("memcpy", "1GiB d2d", "torch-copy", t, 2 * n)
    return 2 * n / (bw * 1e-3) / 1e12


def run_quantize(dev, quick):
    log("== activation quantize")
    for M, K in [(256, 4096), (33, 6144)]:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16) * torch.exp(torch.randn(M, 1, device=dev) * 2)
        x[0, :64] = 0
        for fmt in ("nvfp4", "mxfp4"):
            q = quantize_rows(x, fmt, guidance=True)
            q = type(q)(q.packed.cpu(), q.scales.cpu(), q.outer.cpu(), q.mantissa.cpu(), fmt)
            x = x.cpu()  # the oracle runs on the CPU: on CUDA, torch evaluates `t / 6.0` as t * (1/6) (see NOTES.md)
            if fmt == "nvfp4":
                c, s, o = ref.nvfp4_quantize(x.float(), outer="row")
                ok = torch.equal(q.outer, o)
            else:
                c, s = ref.mxfp4_quantize(x.float())
                ok = True
            parts = dict(outer=ok, codes=torch.equal(q.packed, ref.pack_fp4(c)), scales=torch.equal(q.scales, s),
                         mant=torch.equal(q.mantissa, ref.pack_bits(c & 1)))
            det = {k2: v2 for k2, v2 in parts.items()}
            if not all(parts.values()):
                bad = (ref.unpack_fp4(q.packed) != c).nonzero()[:3].tolist()
                sb = (q.scales != s).nonzero()[:3].tolist()
                det.update(first_code_mismatch=bad, first_scale_mismatch=sb,
                           outer_mismatch=int((q.outer != o).sum()) if fmt == "nvfp4" else 0)
                if sb:
                    r0, b0 = sb[0]
                    det.update(kernel_scale=int(q.scales[r0, b0]), ref_scale=int(s[r0, b0]),
                               amax=float(x[r0, b0 * 16:(b0 + 1) * 16].float().abs().max()), outer=float(o[r0, 0]) if fmt == "nvfp4" else 0)
            check(f"quantize {fmt} {M}x{K} bit-exact", all(parts.values()), json.dumps(det))
    shapes = [(8192, 4096)] + ([] if quick else [(256, 2048), (4096, 14336)])
    for M, K in shapes:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        for fmt, guide in (("nvfp4", False), ("nvfp4", True), ("mxfp4", False)):
            blk = 16 if fmt == "nvfp4" else 32
            nbytes = M * K * 2 + M * K // 2 + M * K // blk + (4 * M if fmt == "nvfp4" else 0) + (M * K // 8 if guide else 0)
            t = bench(lambda: quantize_rows(x, fmt, guidance=guide, check_finite=False))
            record("quantize", f"{M}x{K}", f"triton-{fmt}{'+guide' if guide else ''}", t, nbytes)
        if M * K <= 8192 * 4096 and not quick:
            t = bench(lambda: ref.nvfp4_quantize(x.float(), outer="row"))
            record("quantize", f"{M}x{K}", "torch-reference-nvfp4", t, M * K * 2 + M * K // 2 + M * K // 16 + 4 * M)


def dense_variants(M, N, K, dev):
    d = default_config(M, N, K, dev)
    vs = [d]
    for bn, split, bkw, w, st in [(32, None, 32, 4, 4), (64, None, 64, 4, 3), (128, None, 32, 8, 4),
                                  (64, 1, 32, 4, 4), (32, 1, 64, 4, 4)]:
        sp = d.split if split is None else split
        if M > 64 and sp > 1:
            continue
        c = GemmConfig(BN=bn, BM=d.BM, BKW=bkw, split=sp, num_warps=w, num_stages=st)
        if c not in vs:
            vs.append(c)
    if M <= 16:  # FMA GEMV path (re-reads W from L2 for each extra row)
        for bn, bkw, sp, w in [(16, 16, 4, 4), (32, 16, 4, 4), (16, 32, 2, 4), (64, 8, 4, 4), (32, 16, 8, 8)]:
            vs.append(GemmConfig(kind="gemv", BN=bn, BKW=bkw, split=sp, num_warps=w, num_stages=3))
    return vs


def cfg_str(c):
    return ";".join(f"{k}={v}" for k, v in c.__dict__.items())


def run_dense(dev, quick):
    log("== dense FP4 GEMM")
    # correctness on fresh data, odd sizes included
    for M, N, K in [(1, 14336, 4096), (37, 1000, 4112), (128, 4096, 2048)]:
        c, s, o = nv_weight((N, K), dev)
        pw = prepare_weight(c, s, o)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        for aq in (False, True):
            y = fp4_linear(x, pw, act_quant=aq)
            r = ref.fp4_linear(x.float(), c, s, o, act_quant=aq)
            e = relerr(y, r)
            check(f"dense {'w4a4' if aq else 'w4a16'} M{M} N{N} K{K}", e < 1e-2, f"rel err {e:.2e} (tol 1e-2, bf16 output)")
    shapes = [(14336, 4096), (4096, 14336)] + ([] if quick else [(11264, 2048), (2048, 5632)])
    Ms = [1, 16, 64] if quick else [1, 4, 16, 64, 256]
    for N, K in shapes:
        c, s, o = nv_weight((N, K), dev)
        pw = prepare_weight(c, s, o)
        wb = ref.nvfp4_dequantize(c, s, o).to(torch.bfloat16)
        for M in Ms:
            shape = f"M{M} N{N} K{K}"
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            base = record("dense", shape, "bf16-cublas", bench(lambda: F.linear(x, wb)), N * K * 2 + M * K * 2 + M * N * 2)
            fp4_bytes = pw.nbytes() + M * K * 2 + M * N * 2
            best = None
            for cfg in dense_variants(M, N, K, dev):
                try:
                    t = bench(lambda: fp4_linear(x, pw, config=cfg, check_finite=False))
                except Exception as ex:  # a config that fails to compile is skipped, not fatal
                    log(f"  variant {cfg} failed: {type(ex).__name__}: {str(ex)[:200]}")
                    continue
                ROWS.append(dict(op="dense-sweep", shape=shape, provider="fp4-w4a16", median_ms=round(t[0], 5),
                                 p20_ms=round(t[1], 5), p80_ms=round(t[2], 5), tb_per_s="", speedup_vs_bf16=round(base / t[0], 3),
                                 gpu=GPU, commit=COMMIT, config=cfg_str(cfg)))
                if best is None or t[0] < best[0][0]:
                    best = (t, cfg)
            record("dense", shape, "fp4-w4a16", best[0], fp4_bytes, base, cfg_str(best[1]))
            t = bench(lambda: fp4_linear(x, pw, act_quant=True, config=best[1], check_finite=False))
            record("dense", shape, "fp4-w4a4", t, fp4_bytes, base, cfg_str(best[1]) + ";+act-quant launch")


def route(T, E, k, dev):
    logits = torch.randn(T, E, device=dev)
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    return ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def run_moe(dev, quick):
    log("== grouped MoE FP4")
    # correctness per family, small T (odd), some experts empty
    for fam, (H, I, E, k, _) in FAMILIES.items():
        T = 5
        g, u, d = nv_weight((E, I, H), dev, "expert"), nv_weight((E, I, H), dev, "expert"), nv_weight((E, H, I), dev, "expert")
        mw = prepare_moe_weights(g, u, d)
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        ids, tw = route(T, E, k, dev)
        for aq in (False, True):
            y = fused_moe(x, mw, ids, tw, act_quant=aq)
            r = ref.moe_fp4_reference(x.float(), g, u, d, ids, tw, act_quant=aq)
            e = relerr(y, r)
            tol = 6e-2 if aq else 2e-2  # w4a4: bf16 rounding of h flips a few FP4 codes of the down input
            check(f"moe {fam} T{T} {'w4a4' if aq else 'w4a16'}", e < tol, f"rel err {e:.2e} (tol {tol:g}, bf16 h and output)")
        del g, u, d, mw
    fams = ["qwen3-30b-a3b", "mixtral-8x7b"] if quick else list(FAMILIES)
    Ts = [16, 256] if quick else [1, 16, 64, 256]
    for fam in fams:
        H, I, E, k, _ = FAMILIES[fam]
        g, u, d = nv_weight((E, I, H), dev, "expert"), nv_weight((E, I, H), dev, "expert"), nv_weight((E, H, I), dev, "expert")
        mw = prepare_moe_weights(g, u, d)
        w13 = torch.cat([ref.nvfp4_dequantize(*g), ref.nvfp4_dequantize(*u)], 1).to(torch.bfloat16)  # [E, 2I, H]
        w2 = ref.nvfp4_dequantize(*d).to(torch.bfloat16)  # [E, H, I]
        del g, u, d
        for T in Ts:
            shape = f"{fam} T{T}"
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
            ids, tw = route(T, E, k, dev)
            flat = ids.reshape(-1).long()
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=E)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            hit = int((counts > 0).sum())
            xs = x[order // k].contiguous()  # expert-sorted rows
            w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)

            def bf16_moe():
                h = torch._grouped_mm(xs, w13t, offs=offs)
                a = F.silu(h[:, :I]) * h[:, I:]
                return torch._grouped_mm(a, w2t, offs=offs)
            S = T * k
            act_bytes = T * H * 2 + S * I * 2 * 2 + S * H * 2 + T * H * 2
            base = record("moe", shape, "bf16-grouped_mm", bench(bf16_moe), hit * 3 * H * I * 2 + act_bytes)
            fp4_bytes = hit * 3 * H * I * (0.5 + 1 / 16) + act_bytes
            d0 = default_moe_config(T, k, E)
            variants = [d0] + [MoEConfig(BM=d0.BM, BN=bn, BKW=bkw, num_warps=w, num_stages=st, BN_down=bnd)
                               for bn, bkw, w, st, bnd in [(32, 32, 4, 4, 32), (128, 32, 8, 4, 64), (64, 64, 4, 3, 64),
                                                          (64, 32, 4, 4, 128)]]
            if d0.BM > 16:
                variants.append(MoEConfig(BM=16, BN=64, BKW=32, num_warps=4, num_stages=4, BN_down=64))
            best = None
            for cfg in variants:
                try:
                    al = moe_align(ids, E, cfg.BM)
                    t = bench(lambda: fused_moe(x, mw, ids, tw, config=cfg, align=al, check_finite=False))
                except Exception as ex:
                    log(f"  variant {cfg} failed: {type(ex).__name__}: {str(ex)[:200]}")
                    continue
                ROWS.append(dict(op="moe-sweep", shape=shape, provider="fp4-w4a16", median_ms=round(t[0], 5),
                                 p20_ms=round(t[1], 5), p80_ms=round(t[2], 5), tb_per_s="", speedup_vs_bf16=round(base / t[0], 3),
                                 gpu=GPU, commit=COMMIT, config=cfg_str(cfg)))
                if best is None or t[0] < best[0][0]:
                    best = (t, cfg, al)
            record("moe", shape, "fp4-w4a16", best[0], fp4_bytes, base, cfg_str(best[1]) + f";experts_hit={hit}")
            cfg, al = best[1], best[2]
            t = bench(lambda: fused_moe(x, mw, ids, tw, config=cfg, align=al, act_quant=True, check_finite=False))
            record("moe", shape, "fp4-w4a4", t, fp4_bytes, base, cfg_str(cfg) + ";+2 act-quant launches")
        del mw, w13, w2
        torch.cuda.empty_cache()


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
    ctxs = [8192] if quick else [1024, 4096, 8192, 16384]
    B = 64
    for L in ctxs:
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
        out = decode_attention(q, cache, starts, lens, L)
        check(f"attention vs bf16 sdpa {shape}", relerr(out, ref_o) < 0.15,
              f"rel err {relerr(out, ref_o):.2e} (includes FP4 KV quantization error)")
        nbytes = B * L * cache.nbytes_per_token() + 2 * B * Hq * D * 2
        best = None
        for bn, w, sp in [(64, 4, None), (32, 4, None), (64, 8, None), (128, 8, None), (64, 4, 1)]:
            try:
                t = bench(lambda: decode_attention(q, cache, starts, lens, L, block_n=bn, num_warps=w, num_splits=sp,
                                                   check_finite=False))
            except Exception as ex:
                log(f"  variant bn={bn} w={w} failed: {type(ex).__name__}: {str(ex)[:200]}")
                continue
            cs = f"block_n={bn};num_warps={w};splits={sp or 'auto'}"
            ROWS.append(dict(op="attention-sweep", shape=shape, provider="fp4kv-triton", median_ms=round(t[0], 5),
                             p20_ms=round(t[1], 5), p80_ms=round(t[2], 5), tb_per_s="", speedup_vs_bf16=round(base / t[0], 3),
                             gpu=GPU, commit=COMMIT, config=cs))
            if best is None or t[0] < best[0][0]:
                best = (t, cs)
        record("attention", shape, "fp4kv-triton", best[0], nbytes, base, best[1])
        del kb, vb, cache
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# v1 decode kernels (GEMV layout): dense gemv2 and grouped-MoE gemv, each checked against the FP32
# oracle on fresh data right before it is timed; BF16 baselines timed in the same run.
def gemv2_variants(M, N, K, dev):
    from kernels.gemm import gemv2_config
    d = gemv2_config(M, N, K, dev)
    bm = d.BM
    vs = [d]
    for bn, nw, u, sp, pf in [(32, 4, 2, 1, False), (64, 4, 2, 1, False), (64, 4, 1, 1, False), (16, 4, 2, 1, False),
                              (128, 8, 2, 1, False), (64, 4, 2, 2, False), (32, 4, 2, 4, False),
                              (32, 4, 1, d.split, True), (16, 4, 1, d.split, True), (64, 4, 1, d.split, True)]:
        c = GemmConfig(kind="gemv2", BN=bn, BM=bm, split=sp, num_warps=nw, num_stages=1, U=u, prefetch=pf)
        if c not in vs:
            vs.append(c)
    return vs


def run_dense_v1(dev, quick):
    log("== dense FP4 GEMM, v1 GEMV path")
    shapes = [(14336, 4096), (4096, 14336)] + ([] if quick else [(2048, 5632)])
    Ms = [1, 2, 4, 8, 16]
    for N, K in shapes:
        c, s, o = nv_weight((N, K), dev)
        pw = prepare_weight(c, s, o)
        wb = ref.nvfp4_dequantize(c, s, o).to(torch.bfloat16)
        for M in Ms:
            shape = f"M{M} N{N} K{K}"
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            r = ref.fp4_linear(x.float(), c, s, o)
            base = record("dense", shape, "bf16-cublas", bench(lambda: F.linear(x, wb)), N * K * 2 + M * K * 2 + M * N * 2)
            fp4_bytes = pw.gv_words.numel() * 4 + pw.gv_scales.numel() + M * K * 2 + M * N * 2
            best = None
            for cfg in gemv2_variants(M, N, K, dev):
                try:
                    y = fp4_linear(x, pw, config=cfg, check_finite=False)
                    e = relerr(y, r)
                    ok = e < 1e-2
                    check(f"dense v1 {shape} {cfg_str(cfg)}", ok, f"rel err {e:.2e} (tol 1e-2, bf16 output)")
                    if not ok:
                        continue
                    t = bench(lambda: fp4_linear(x, pw, config=cfg, check_finite=False))
                except Exception as ex:
                    log(f"  variant {cfg} failed: {type(ex).__name__}: {str(ex)[:300]}")
                    continue
                ROWS.append(dict(op="dense-sweep", shape=shape, provider="fp4-w4a16-v1", median_ms=round(t[0], 5),
                                 p20_ms=round(t[1], 5), p80_ms=round(t[2], 5), tb_per_s="", speedup_vs_bf16=round(base / t[0], 3),
                                 gpu=GPU, commit=COMMIT, config=cfg_str(cfg)))
                if best is None or t[0] < best[0][0]:
                    best = (t, cfg)
            if best:
                record("dense", shape, "fp4-w4a16-v1", best[0], fp4_bytes, base, cfg_str(best[1]))
            if M == 1 and N == 14336:  # the v0 default in the same run, for reference
                t = bench(lambda: fp4_linear(x, pw, config=default_config(M, N, K, dev), check_finite=False))
                record("dense", shape, "fp4-w4a16-v0mma", t, pw.nbytes() + M * K * 2 + M * N * 2, base,
                       cfg_str(default_config(M, N, K, dev)))


def run_moe_v1(dev, quick):
    log("== grouped MoE FP4, v1 GEMV path")
    fams = ["qwen3-30b-a3b"] if quick else ["qwen3-30b-a3b", "olmoe-1b-7b"]
    for fam in fams:
        H, I, E, k, _ = FAMILIES[fam]
        wg, wu, wd = (nv_weight((E, I, H), dev, "expert"), nv_weight((E, I, H), dev, "expert"),
                      nv_weight((E, H, I), dev, "expert"))
        mw = prepare_moe_weights(wg, wu, wd)
        w13 = torch.cat([ref.nvfp4_dequantize(*wg), ref.nvfp4_dequantize(*wu)], 1).to(torch.bfloat16)
        w2 = ref.nvfp4_dequantize(*wd).to(torch.bfloat16)
        w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
        for T in [1, 16, 64]:
            shape = f"{fam} T{T}"
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
            ids, tw = route(T, E, k, dev)
            r = ref.moe_fp4_reference(x.float(), wg, wu, wd, ids, tw)  # (first run: `u` was shadowed by a loop var)
            flat = ids.reshape(-1).long()
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=E)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            hit = int((counts > 0).sum())
            xs = x[order // k].contiguous()

            def bf16_moe():
                h = torch._grouped_mm(xs, w13t, offs=offs)
                a = F.silu(h[:, :I]) * h[:, I:]
                return torch._grouped_mm(a, w2t, offs=offs)
            S = T * k
            act_bytes = T * H * 2 + S * I * 2 * 2 + S * H * 2 + T * H * 2
            base = record("moe", shape, "bf16-grouped_mm", bench(bf16_moe), hit * 3 * H * I * 2 + act_bytes)
            fp4_bytes = hit * 3 * H * I * (0.5 + 1 / 8) + act_bytes  # v1 layout: 4 scale bytes per 32 weights
            d0 = default_moe_config(T, k, E)
            variants = [d0]
            for bm in (1, 2, 4):
                for bn, bnd, uu, nw in [(32, 32, 1, 4), (64, 64, 1, 4), (32, 32, 2, 4), (16, 16, 1, 4)]:
                    c = MoEConfig(BM=bm, BN=bn, BN_down=bnd, num_warps=nw, num_stages=1, kind="gemv", U=uu)
                    if c not in variants:
                        variants.append(c)
            best = None
            for cfg in variants:
                try:
                    al = moe_align(ids, E, cfg.BM)
                    y = fused_moe(x, mw, ids, tw, config=cfg, align=al, check_finite=False)
                    e = relerr(y, r)
                    ok = e < 2e-2
                    check(f"moe v1 {shape} {cfg_str(cfg)}", ok, f"rel err {e:.2e} (tol 2e-2, bf16 h and output)")
                    if not ok:
                        continue
                    t = bench(lambda: fused_moe(x, mw, ids, tw, config=cfg, align=al, check_finite=False))
                except Exception as ex:
                    log(f"  variant {cfg} failed: {type(ex).__name__}: {str(ex)[:300]}")
                    continue
                ROWS.append(dict(op="moe-sweep", shape=shape, provider="fp4-w4a16-v1", median_ms=round(t[0], 5),
                                 p20_ms=round(t[1], 5), p80_ms=round(t[2], 5), tb_per_s="", speedup_vs_bf16=round(base / t[0], 3),
                                 gpu=GPU, commit=COMMIT, config=cfg_str(cfg)))
                if best is None or t[0] < best[0][0]:
                    best = (t, cfg)
            if best:
                record("moe", shape, "fp4-w4a16-v1", best[0], fp4_bytes, base, cfg_str(best[1]) + f";experts_hit={hit}")
        del mw, w13, w2, w13t, w2t, wg, wu, wd
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# Offline SASS of the v1 GEMV kernel (no GPU needed: Triton compiles for sm_90 with its bundled
# ptxas; cuobjdump disassembles). Counts the instructions of the main loop per weight.
def sass_counts(out_csv):
    import glob
    import re
    from collections import Counter

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.gemm import _fp4_gemv2_kernel
    bindir = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin"))[0]
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "wf_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32",
           "K": "i32", "G": "i32", "stride_xm": "i32", "g_per_split": "i32", "BN": "constexpr", "BM": "constexpr",
           "U": "constexpr", "SPLIT": "constexpr", "NIT": "constexpr", "EVEN": "constexpr", "PREFETCH": "constexpr"}
    aligned = ["x_ptr", "w_ptr", "s_ptr", "wf_ptr", "out_ptr", "N", "K", "stride_xm"]
    attrs = {(list(sig).index(k),): [["tt.divisibility", 16]] for k in aligned}
    rows = []
    for bn, bm, u, nw, pf in [(32, 1, 2, 4, False), (64, 1, 2, 4, False), (16, 1, 2, 4, False), (32, 2, 2, 4, False),
                              (32, 4, 2, 4, False), (64, 4, 2, 4, False), (32, 1, 1, 4, True)]:
        cst = dict(BN=bn, BM=bm, U=u, SPLIT=1, NIT=16 // u, EVEN=not pf, PREFETCH=pf)  # K=4096: 16 groups
        ck = triton.compile(ASTSource(fn=_fp4_gemv2_kernel, signature=sig, constexprs=cst, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw, num_stages=1))
        path = f"/tmp/gemv2_{bn}_{bm}_{u}_{nw}_{int(pf)}.cubin"
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
        ins = []
        for line in sass.splitlines():
            m = re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line)
            if m:
                ins.append((int(m.group(1), 16), m.group(2).strip()))
        body = []
        for a, t in ins:  # the loop = the span of the (last) backward branch
            tg = re.search(r"BRA\s+0x([0-9a-f]+)", t)
            if tg and int(tg.group(1), 16) < a:
                body = [x for b, x in ins if int(tg.group(1), 16) <= b <= a]
        ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in body)
        wpt = (bn // (4 * nw)) * 32 * u  # weights per thread per iteration (rows/thread * 32 * U)
        rows.append(dict(kernel="_fp4_gemv2_kernel", config=f"BN={bn};BM={bm};U={u};num_warps={nw};prefetch={pf}",
                         ttgir_convert_layouts=ck.asm["ttgir"].count("convert_layout"), loop_instr=len(body),
                         weights_per_thread_iter=wpt, instr_per_weight=round(len(body) / wpt, 3),
                         instr_per_weight_row=round(len(body) / wpt / bm, 3),
                         top_ops=" ".join(f"{k}:{v}" for k, v in ops.most_common(8))))
        log(rows[-1])
    with open(out_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main():
    global GPU, COMMIT, OUT_PATH
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/kernels/kernels.csv")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--only", default="quantize,dense,attention,moe")
    ap.add_argument("--sass", default=None, help="offline: write v1 GEMV SASS instruction counts to this CSV and exit")
    args = ap.parse_args()
    if args.sass:
        return sass_counts(args.sass)
    OUT_PATH = args.out
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    dev = torch.device("cuda")
    GPU = torch.cuda.get_device_name(dev)
    COMMIT = args.commit or os.environ.get("GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    torch.manual_seed(int(time.time()))  # fresh random data every run
    log(f"GPU {GPU}, torch {torch.__version__}, triton {triton.__version__}, commit {COMMIT}")
    copy_bw = bench_copy(dev)
    log(f"copy bandwidth (read+write) {copy_bw:.2f} TB/s")
    t0 = time.time()
    for part in args.only.split(","):
        try:
            {"quantize": run_quantize, "dense": run_dense, "moe": run_moe, "attention": run_attention,
             "dense_v1": run_dense_v1, "moe_v1": run_moe_v1}[part](dev, args.quick)
        except Exception:
            log(f"!! {part} failed:\n{traceback.format_exc()}")
        log(f"   [{part} done at {time.time() - t0:.0f}s]")
        write(args.out)
    write(args.out)
    log("\n== summary (medians; % of measured copy bandwidth)")
    for r in ROWS:
        if r["op"].endswith("sweep") or r["op"] == "memcpy":
            continue
        pct = f"{100 * r['tb_per_s'] / copy_bw:5.1f}%" if r["tb_per_s"] != "" else "      "
        log(f"{r['op']:9s} {r['shape']:38s} {r['provider']:22s} {r['median_ms']*1e3:9.1f} us {pct} x{r['speedup_vs_bf16']}")
    nfail = sum(not c["ok"] for c in CHECKS)
    log(f"checks: {len(CHECKS) - nfail} ok, {nfail} failed")


def write(path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    cols = ["op", "shape", "provider", "median_ms", "p20_ms", "p80_ms", "tb_per_s", "speedup_vs_bf16", "gpu", "commit", "config"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(ROWS)
    with open(os.path.splitext(path)[0] + "_checks.json", "w") as f:
        json.dump(CHECKS, f, indent=1)


if __name__ == "__main__":
    main()
