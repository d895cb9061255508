"""The FP4-KV decode attention part of the kernel benchmark."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.kernel_bench.harness import bench, check, log, record, relerr, sweep_row
from kernels import reference as ref
from kernels.attention import FP4KVCache, decode_attention, kv_store


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
