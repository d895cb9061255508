"""Triton fast path of the rollout engine (W4A4 NVFP4 on a GPU): FP4 GEMMs, grouped MoE, FP4-KV decode attention.

What: `TritonPath.build(weights)` re-lays the engine's FP4 weights (the FP4Tensors that
`trace.fp4.quantize_weight` produced at sync) into the kernel layouts of `kernels.gemm.prepare_weight`
and `kernels.moe.prepare_moe_weights`; the engine forward then calls
  - `kernels.gemm.fp4_linear(x, w, act_quant=True)` for q/k/v/o and shared-expert / dense-MLP linears
    (the activation is quantized per row inside, bit-identical to `trace.fp4.quantize(x, "nvfp4", "row")`),
  - `kernels.moe.fused_moe(x, w, topk_ids, topk_weights, act_quant=True)` for the routed experts
    (per-token gate/up input, per-(token, slot) down input),
  - `kernels.attention.kv_store` + `decode_attention` for one-token decode steps with the FP4 KV cache
    (a zero-copy view of the engine's cache buffers).
It is used only when the device is CUDA (or forced for interpreter tests), mode is w4a4, fmt nvfp4. In
one-token decode steps the kernels run the projections up to the sizes where they beat BF16 tensor cores
(`crossover`, measured), and larger ones take the quantize kernel's codes (and dequantized copy) into BF16
GEMMs on the dequantized weights; prefill and multi-token chunks always do the latter (`ChunkPath`: they
are compute-bound, where the MMA kernels measured slower than BF16 GEMMs; kernels/NOTES.md, "The engine's
decode step"), a fresh prefill storing its K/V through the same quantize kernel. A recorder gets the
activations' codes from the kernels' own quantize (`keep` callbacks: no second quantization) and the K/V
codes read back from the cache kv_store wrote (KVCache.stored). `RolloutEngine(fp4_backend="torch")` or
TRACE_ROLLOUT_BACKEND=torch disables it (=triton forces it on a CPU under TRITON_INTERPRET=1).

On a GPU the engine runs `TritonPath.self_test` at its first weight sync: the kernels against
`kernels.reference` at the model's own widths and row counts, so a kernel that is wrong at a shape no
test used stops the run instead of skewing it.

Compared against: the engine's torch path (tests/rollout/test_fast.py runs it under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch

from trace import fp4
from trace.rollout.weights import copy_into
from trace.settings import switch

BACKENDS = ("auto", "torch", "triton")

# Which code runs a decode step's projection, by size: the W4A4 kernels (the MoE decode GEMV at the fewest rows,
# the MMA tile above, kernels.gemm.auto_config / kernels.moe.default_moe_config) up to these sizes, above them
# the step quantizes the activation with the same kernel (same codes, one launch, its dequantized copy) and
# multiplies on BF16 tensor cores with the dequantized weights, as prefill does. The sizes are the largest at
# which a kernel beat that path at every timed shape on the H200 (results/kernels/crossover.md, from
# `python benchmarks/crossover.py`): dense rows up to 16, the largest timed (the
# MMA tile 35.8-36.2 us against 47.3-50.5), and routed experts up to 64 (token, slot) rows per expert (T*k/E), the
# largest timed (Mixtral-8x7B T256 811.3 against 1144.7 us; Qwen3-30B-A3B T256, 16 per expert, 218.7 against 561.4).
# The switch `engine.fp4_crossover` = "ROWS,LOAD" (trace/settings.py; $TRACE_FP4_CROSSOVER) overrides both (e.g.
# "inf,inf": kernels at every size; "0,0": never), for benchmarks and tests.
DENSE_KERNEL_ROWS = 16
MOE_KERNEL_LOAD = 64.0


def crossover() -> tuple[float, float]:
    """(largest row count for the dense kernels, largest rows per expert for the MoE kernels)."""
    value = switch("engine.fp4_crossover")
    if not value:
        return float(DENSE_KERNEL_ROWS), MOE_KERNEL_LOAD
    rows, load = (float(v) for v in value.split(","))
    return rows, load


def available(device, dtype=torch.bfloat16, backend: str = "auto") -> bool:
    """Triton path on CUDA by default; on a CPU only when asked for (backend="triton" or
    the switch `engine.backend` = triton, with TRITON_INTERPRET=1, for tests). backend="torch" (or the switch,
    when backend is "auto") disables it everywhere."""
    if backend not in BACKENDS:
        raise ValueError(f"fp4_backend must be one of {BACKENDS}, got {backend!r}")
    want = backend if backend != "auto" else switch("engine.backend")
    if want == "torch":
        return False
    if torch.device(device).type != "cuda" and want != "triton":
        return False
    if torch.device(device).type == "cuda" and dtype == torch.float32 and want != "triton":
        return False  # the GPU kernels take bf16/fp16 activations (a float32 run raised ValueError on the H200)
    try:
        import kernels.attention  # noqa: F401
        import kernels.gemm  # noqa: F401
        import kernels.moe  # noqa: F401
    except Exception:  # noqa: BLE001 - kernels missing or broken: use the torch path
        return False
    return True


def fused_ops(device, dtype=torch.bfloat16, backend: str = "auto") -> bool:
    """Whether the engine's forward, in either mode, takes `kernels.norm` (residual add + RMSNorm, q/k norm + RoPE)
    and `kernels.routing` (the router's softmax + top-k + renormalisation): one launch each where torch makes ~6-8.
    On CUDA where the Triton path would run (`available`). Not on a CPU, where the interpreter's tests compare the
    Triton path's GEMMs against the torch path's records bit for bit and these may differ in last bits (the inverse
    RMS, the exponentials); tests/rollout/test_fast.py turns them on by hand."""
    if torch.device(device).type != "cuda" or not available(device, dtype, backend):
        return False
    try:
        import kernels.norm  # noqa: F401
        import kernels.routing  # noqa: F401
    except Exception:  # noqa: BLE001 - kernels missing or broken: the torch ops
        return False
    return True


def fused_sampling() -> bool:
    """Whether the engine samples on a GPU with `kernels.sampling.fused_sample` (Triton importable); off with
    the switch `engine.backend` = torch, as the other kernels."""
    if switch("engine.backend") == "torch":
        return False
    try:
        import kernels.sampling  # noqa: F401
    except Exception:  # noqa: BLE001 - kernels missing or broken: the torch passes
        return False
    return True


def attention_wanted() -> str:
    """The FP4-KV decode attention kernel, read when the engine builds its Triton path (a CUDA graph captured later
    keeps what was read then): the switch `engine.fp4_attn` = triton the Triton kernel (kernels/attention.py), else the register-operand
    Gluon kernel (kernels/attention_mma.py) where it applies (head dim 128, <= 16 query heads per KV head; Triton
    with Gluon): 1.30x / 1.37x the Triton kernel at B256 x 1k / B64 x 8k on the H200 (kernels/NOTES.md, "FP4-KV decode
    attention")."""
    if switch("engine.fp4_attn") == "triton":
        return "triton"
    from kernels.attention_mma import gluon

    return "mma" if gluon is not None else "triton"


class TritonPath:
    def __init__(self, dense: list[dict], moe: list, batch_invariant: bool = False):
        """dense / moe: per layer, the kernels' prepared weights. batch_invariant: every projection, expert and
        attention of any chunk on the kernels' batch-invariant mode (`kernels.batch_invariant`, DESIGN.md §4 "Exact
        on-policy arm"), prefill included; the default mode's crossover and configs are not used then."""
        self.dense, self.moe = dense, moe
        self.dense_rows, self.moe_load = crossover()
        self.attn = attention_wanted()
        self.bi = batch_invariant

    def dense_kernels(self, rows: int) -> bool:
        """Whether a projection of `rows` activation rows runs on the W4A4 kernels (else BF16 GEMMs)."""
        return self.bi or rows <= self.dense_rows

    def moe_kernels(self, i: int, tokens: int, k: int) -> bool:
        """Whether layer i's routed experts for `tokens` tokens of top-k run on the W4A4 MoE kernels."""
        return self.bi or tokens * k / self.moe[i].E <= self.moe_load

    @staticmethod
    def build(weights, batch_invariant: bool = False) -> "TritonPath":
        layers = [_prepare_layer(weights, i) for i in range(weights.arch.num_layers)]
        return TritonPath([d for d, _ in layers], [m for _, m in layers], batch_invariant)

    def refresh(self, weights) -> None:
        """Re-lay the engine's FP4 weights after a per-tensor sync rewrote them (`RolloutEngine.finish_sync`), one
        layer at a time, into the prepared tensors this path holds (`copy_into`: decode graphs read them by
        address), so that at most one layer's new layouts exist beside the held ones."""
        for i in range(weights.arch.num_layers):
            if not copy_into((self.dense[i], self.moe[i]), _prepare_layer(weights, i)):
                raise RuntimeError(f"layer {i}: the re-quantized FP4 weights no longer fit the kernels' prepared "
                                   "layouts the engine holds")

    def self_test(self, weights, dtype: torch.dtype, device, rows=(1, 2, 5, 64, 300), seed: int = 0) -> None:
        """Check the kernels against `kernels.reference` at this model's own shapes before a run uses
        them, and raise RuntimeError naming the kernel and shape where they disagree: activation codes,
        scale bytes and S_enc bit-exact at every width the path quantizes (both variants: codes only, and
        with the dequantized copy the decode GEMV reads), every dense weight of the first layer that has
        one and the first MoE layer's experts within 1e-2 of the oracle (W4A4 on the MMA kernels, W4A16 on
        the GEMV ones, see below). rows: activation
        rows per call (the default configs take the GEMV kernels up to 2 dense rows and 1.5 rows per expert,
        the MMA ones above); the quantize is checked at all of them, the GEMMs only at those this path runs
        on the kernels (`dense_kernels`, `moe_kernels`; with the default crossover 1, 2 and 5 dense rows, the
        MMA tile at 5). A Triton miscompile at one
        quantize tile saturated every code on an H200 at a width no kernel test used (kernels/NOTES.md,
        "Correctness: what holds and what it took"); this is what catches the next one. Costs a few seconds of compiles on a GPU."""
        from kernels.attention import FP4KVCache, decode_attention, kv_store
        from kernels.gemm import fp4_linear
        from kernels.moe import default_moe_config, fused_moe
        from trace.fp4 import reference as ref
        from trace.fp4.rows import quantize_rows

        dev = torch.device(device)
        g = torch.Generator().manual_seed(seed)

        def rand(m, k):  # rows of different magnitude, so the per-row outer scales differ
            x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
            return x.to(dtype)

        def rel(y, r):  # relative L2 error of a kernel output against the oracle's
            return float((y - r).norm() / r.norm().clamp_min(1e-30))

        def fail(what, shape, detail):
            raise RuntimeError(f"FP4 fast path self-test: {what} at {shape} disagrees with kernels.reference "
                               f"({detail}); run with fp4_backend='torch' (TRACE_ROLLOUT_BACKEND=torch) and "
                               f"report the GPU, Triton version and shape")

        widths = sorted({w.K for d in self.dense for w in d.values()}
                        | {k for m in self.moe if m is not None for k in (m.H, m.I)})
        for K in widths:
            for M in rows:
                x = rand(M, K)
                c, s, o = ref.nvfp4_quantize(x.float(), outer="row")
                for fake in (None, dtype):
                    q = quantize_rows(x.to(dev), "nvfp4", fake_dtype=fake, check_finite=False)
                    ok = {"codes": torch.equal(q.codes().cpu(), c), "scales": torch.equal(q.scales.cpu(), s),
                          "outer": torch.equal(q.outer.cpu().reshape(-1), o.reshape(-1))}
                    if fake is not None:  # a multiply by 1/S_enc instead of a division: within an ulp of dtype
                        deq = ref.nvfp4_dequantize(c, s, o)
                        ok["dequantized"] = torch.allclose(q.fake.cpu().float(), deq, rtol=2 * torch.finfo(dtype).eps,
                                                           atol=0.0)
                    if not all(ok.values()):
                        fail("activation quantize" + (" (+dequantized)" if fake else ""), (M, K), ok)
        layer = next((i for i, d in enumerate(self.dense) if d), None)
        for key, t in ({} if layer is None else _dense_fp4(weights, layer)).items():
            w = self.dense[layer][key]
            for M in (M for M in rows if self.dense_kernels(M)):
                x = rand(M, w.K)
                if self.bi:  # the batch-invariant mode's config, the one its forward runs
                    from kernels.batch_invariant import fp4_linear_bi

                    y = fp4_linear_bi(x.to(dev), w).float().cpu()
                else:
                    y = fp4_linear(x.to(dev), w, act_quant=True, out_dtype=torch.float32, check_finite=False).cpu()
                r = ref.fp4_linear(x.float(), t.codes.cpu(), t.scales.cpu(), t.outer.cpu(), act_quant=True)
                err = rel(y, r)
                if not err < 1e-2:
                    fail(f"W4A4 linear {key} of layer {layer}", (M, w.N, w.K), f"rel. error {err:.3g}, tol 1e-2")
        a = weights.arch  # FP4-KV store and decode attention at the model's heads: 3 sequences, lengths 40, 0, 17
        B, L, lens = 3, 40, torch.tensor([40, 0, 17])
        kv = FP4KVCache.allocate(B * L, a.num_kv_heads, a.head_dim, dev)
        k, v = rand(B * L * a.num_kv_heads, a.head_dim), rand(B * L * a.num_kv_heads, a.head_dim)
        k, v = (t.view(B * L, a.num_kv_heads, a.head_dim) for t in (k, v))
        q = rand(B * a.num_heads, a.head_dim).view(B, a.num_heads, a.head_dim)
        kv_store(kv, k.to(dev), v.to(dev), torch.arange(B * L, device=dev), check_finite=False)
        c, s, o = ref.nvfp4_quantize(k.float(), outer="row")
        if not (torch.equal(kv.k_packed.cpu(), ref.pack_fp4(c)) and torch.equal(kv.k_scales.cpu(), s)):
            fail("FP4 KV store", (B * L, a.num_kv_heads, a.head_dim), "codes or scales")
        kh, vh = (ref.kv_dequantize(p.cpu(), sc.cpu(), ou.cpu()).view(B, L, a.num_kv_heads, a.head_dim)
                  for p, sc, ou in ((kv.k_packed, kv.k_scales, kv.k_outer), (kv.v_packed, kv.v_scales, kv.v_outer)))
        r = ref.decode_attention_reference(q.float(), kh, vh, lens)
        attend = [("", decode_attention)]
        if self.mma_attention(a.head_dim, a.num_heads // a.num_kv_heads):
            from kernels.attention_mma import decode_attention_mma  # the kernel the engine's steps take

            attend.append((" (register-operand kernel)", decode_attention_mma))
        if self.bi:
            from kernels.batch_invariant import attention as bi_attention

            attend.append((" (batch-invariant)", lambda *args, check_finite: bi_attention(*args)))
        for name, fn in attend:
            y = fn(q.to(dev).to(dtype), kv, torch.arange(B, device=dev) * L, lens.to(dev), L,
                   check_finite=False).float().cpu()
            err = rel(y, r)
            if not err < 5e-3:
                fail("FP4-KV decode attention" + name, (B, a.num_heads, a.num_kv_heads, a.head_dim),
                     f"rel. error {err:.3g}, tol 5e-3")
        layer = next((i for i, m in enumerate(self.moe) if m is not None), None)
        if layer is not None:
            m = self.moe[layer]
            gate, up, down = (tuple(x.cpu() for x in (t.codes, t.scales, t.outer)) for t in _expert_fp4(weights, layer))
            k = min(weights.arch.top_k, m.E)
            for T in (T for T in rows if self.moe_kernels(layer, T, k)):
                x = rand(T, m.H)
                ids = torch.stack([torch.randperm(m.E, generator=g)[:k] for _ in range(T)])
                wts = torch.rand(T, k, generator=g)
                # The MMA kernels multiply the activations' exact FP4 values (the quantize pass's tile values,
                # S_enc applied after the MMA) and keep h in x's dtype, which the oracle reproduces (h_dtype), so
                # W4A4 is compared there. The GEMV kernels read the dequantized
                # activations rounded to x's dtype (a multiply by 1/S_enc, within an ulp), which moves h by
                # about an ulp and can flip its FP4 codes; one flip at I = 64 is a ~10% output error, so
                # they are compared in W4A16 (their activation quantize is the one checked bit-exact above).
                aq = self.bi or default_moe_config(T, k, m.E).kind == "mma"
                if self.bi:  # the batch-invariant mode's MMA tile
                    from kernels.batch_invariant import fused_moe_bi

                    y = fused_moe_bi(x.to(dev), m, ids.to(dev), wts.to(dev)).float().cpu()
                else:
                    y = fused_moe(x.to(dev), m, ids.to(dev), wts.to(dev), act_quant=aq, check_finite=False).float().cpu()
                r = ref.moe_fp4_reference(x.float(), gate, up, down, ids, wts, act_quant=aq, h_dtype=dtype)
                err = rel(y, r)
                if not err < 1e-2:
                    fail(f"W4{'A4' if aq else 'A16'} experts of layer {layer}", (T, m.E, m.H, m.I),
                         f"rel. error {err:.3g}, tol 1e-2")

    def linear(self, i: int, key: str, x: torch.Tensor, bias=None, keep=None) -> torch.Tensor:
        """x [N, K] (unquantized) -> W4A4 x @ W^T [N, out] (+ bias). keep(FP4Tensor [N, K]), if given,
        gets the activation's quantization as the kernel used it (a recorder's site); a record sink
        (`trace.fp4.rows.record_sink`) is written by the activation's quantize launch itself."""
        from kernels.gemm import fp4_linear

        seen = observer(keep, x.dtype)
        if self.bi:
            from kernels.batch_invariant import fp4_linear_bi

            y = fp4_linear_bi(x, self.dense[i][key], on_quant=seen)
        else:
            y = fp4_linear(x, self.dense[i][key], act_quant=True, check_finite=False, on_quant=seen)
        return y if bias is None else y + bias

    def experts(self, i: int, x, topi, topv, keep_in=None, keep_down=None) -> torch.Tensor:
        """x [N, H] -> [N, H]. keep_in(FP4Tensor [N, H]) / keep_down(FP4Tensor [N, k, I]), if given, get
        the gate/up input's and the down input's quantization as the kernels used them; record sinks there are
        written by the activations' quantize launches themselves."""
        from kernels.moe import fused_moe

        N, k = topi.shape
        obs = {"gate_up": observer(keep_in, x.dtype, (N,)), "down": observer(keep_down, x.dtype, (N, k))}
        if keep_in is None and keep_down is None:
            obs = None
        if self.bi:
            from kernels.batch_invariant import fused_moe_bi

            seen = None if obs is None else (lambda which, q: obs[which] is not None and obs[which](q))
            return fused_moe_bi(x, self.moe[i], topi, topv, on_quant=seen)
        return fused_moe(x, self.moe[i], topi, topv, act_quant=True, check_finite=False, on_quant=obs)

    def mma_attention(self, head_dim: int, groups: int) -> bool:
        """Whether decode steps take the register-operand attention (chosen, and applicable at these heads)."""
        if self.attn != "mma":
            return False
        from kernels.attention_mma import applies

        return applies(head_dim, groups)

    def decode_attention(self, cache, layer: int, rows, slots, start, lens, q, k, v, max_len: int,
                         record=None) -> torch.Tensor:
        """One-token decode with the FP4 KV cache: store k, v [R, 1, Hkv, D] at (rows, slots) and attend
        q [R, 1, Hq, D] over slots 0 .. start[r] + lens[r] - 1 of each row (lens 0: an idle row, its cached
        tokens only). Returns [R, Hq, D]. record: (sink of k, sink of v), written by the store's launches."""
        from kernels.attention import decode_attention, kv_store

        per = cache.cap + 1
        R = q.shape[0]
        r = cache.row_ids(rows, q.device)
        view = _kv_view(cache, layer)
        flat_slots = r * per + slots[:, 0]  # [R]
        kv_store(view, k[:, 0], v[:, 0], flat_slots, check_finite=False, record=record)
        if self.mma_attention(q.shape[-1], q.shape[2] // k.shape[2]):
            from kernels.attention_mma import decode_attention_mma

            out = decode_attention_mma(q[:, 0], view, r * per, start + lens, max_len, check_finite=False)
        else:
            out = decode_attention(q[:, 0], view, r * per, start + lens, max_len, check_finite=False)
        return out.view(R, *q.shape[2:])


    # ---------------------------------------------------------------- batch-invariant mode only
    def attend(self, cache, layer: int, rows, slots, start, lens, q, k, v, max_len: int) -> torch.Tensor:
        """Any chunk (a decode step, a prefill, an appended observation) in the batch-invariant mode: store k, v
        [R, T, Hkv, D] at (rows, slots) (padding at the trash slot) and attend each query q [R, T, Hq, D] at position
        p over its row's slots 0 .. p (a padded position, and a decode step's idle row (lens 0), over the row's
        tokens start .. start + lens - 1 only) with `kernels.batch_invariant.attention`: every query one program of
        the decode kernel over the same key tiles, so a decode step's query equals the same position's in a
        prefill bit for bit. Returns [R, T, Hq, D]."""
        from kernels.attention import kv_store
        from kernels.batch_invariant import attention

        R, T, Hq, D = q.shape
        Hkv = k.shape[2]
        per = cache.cap + 1
        r = cache.row_ids(rows, q.device)
        view = _kv_view(cache, layer)
        kv_store(view, k.reshape(R * T, Hkv, D), v.reshape(R * T, Hkv, D), (r[:, None] * per + slots).reshape(-1),
                 check_finite=False)
        t = torch.arange(T, device=q.device)
        upto = torch.where(t[None, :] < lens[:, None], start[:, None] + t + 1, (start + lens)[:, None])  # [R, T]
        base = (r * per).repeat_interleave(T)  # [R*T] contiguous (the kernel reads it by index)
        return attention(q.reshape(R * T, Hq, D), view, base, upto.reshape(-1), max_len).view(R, T, Hq, D)

    @staticmethod
    def plain_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """An unquantized linear (router, shared-expert gate, lm_head) in the batch-invariant mode."""
        from kernels.batch_invariant import linear

        return linear(x, w, bias)

    @staticmethod
    def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        from kernels.batch_invariant import silu_mul

        return silu_mul(g, u)

    @staticmethod
    def sigmoid(a: torch.Tensor) -> torch.Tensor:
        from kernels.batch_invariant import sigmoid

        return sigmoid(a)

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        """log_softmax(logits / temperature)[row, token] [A] fp32, per row (`kernels.batch_invariant.token_logprobs`):
        the rollout's log-prob of a sampled token and the trainer's of the same target are the same computation."""
        from kernels.batch_invariant import token_logprobs

        return token_logprobs(logits, tokens, temperature)


def _kv_view(cache, layer: int):
    """A zero-copy `kernels.attention.FP4KVCache` over layer `layer` of the engine's cache (slot s of row b at
    b * (cap + 1) + s)."""
    from kernels.attention import FP4KVCache

    views = []
    for j in range(2):
        c, s, o = cache.codes[layer][j], cache.scales[layer][j], cache.outer[layer][j]  # [B, cap+1, Hkv, ..]
        views += [c.view(-1, *c.shape[2:]), s.view(-1, *s.shape[2:]), o.view(-1, o.shape[2])]
    return FP4KVCache(*views)


class ChunkPath:
    """The Triton path in a prefill or multi-token chunk (compute-bound: BF16 GEMMs on the dequantized
    weights, never the FP4 GEMM kernels): the quantize kernel gives each activation site's codes (the
    oracle's) and dequantized copy (`_act_fast`, as a decode step above the crossover does), and a fresh
    prefill stores its K/V in the FP4 cache through the same kernel (`prefill_kv`), rather than the torch
    oracle's quantization at every site and a decode of the whole cache for attention (kernels/NOTES.md,
    "The engine's decode step")."""

    @staticmethod
    def dense_kernels(rows: int) -> bool:
        return False

    @staticmethod
    def moe_kernels(i: int, tokens: int, k: int) -> bool:
        return False

    @staticmethod
    def prefill_kv(cache, layer: int, rows, slots, k, v):
        """Fresh prefill on the FP4 KV cache: k, v [R, T, Hkv, D] quantized per (token, head) by the quantize
        kernel and stored at (rows, slots); returns their dequantized values [R, T, Hkv, D] in the cache
        dtype, bit for bit what `KVCache.read` decodes of them (`fake_exact`), and the kernel's QuantizedRows
        of k and v (for a recorder: `as_fp4`)."""
        from trace.fp4.rows import quantize_rows

        idx = cache.index(rows, slots)
        vals, qs = [], []
        for j, x in enumerate((k, v)):
            q = quantize_rows(x.reshape(-1, x.shape[-1]), "nvfp4", fake_dtype=cache.dtype, fake_exact=True,
                              check_finite=False)  # rows (token, head) of [R*T*Hkv, D]
            cache.put_codes(layer, j, idx, q.packed, q.scales, q.outer)
            vals.append(q.fake.view(x.shape))
            qs.append(q)
        return vals[0], vals[1], qs


CHUNK = ChunkPath()


def observer(keep, dtype: torch.dtype, lead: tuple | None = None):
    """What a kernel's on_quant gets for a recorder's `keep`: None, a record sink as it is (the quantize launch
    writes it), or keep(FP4Tensor) of the kernel's QuantizedRows (`as_fp4`, leading dims `lead`)."""
    if keep is None or fp4.rows.is_record_sink(keep):
        return keep
    return lambda q: keep(as_fp4(q, dtype, lead))


def as_fp4(q, dtype: torch.dtype, lead: tuple | None = None) -> fp4.FP4Tensor:
    """A quantize kernel's rows (kernels.quantize.QuantizedRows, [M, ...]) as the FP4Tensor that
    `trace.rollout.cache.quant_rows` makes of the same rows: codes unpacked, leading dims `lead` (default
    the rows' own)."""
    lead = tuple(q.packed.shape[:-1]) if lead is None else tuple(lead)
    codes = q.codes()
    return fp4.FP4Tensor(codes.reshape(*lead, codes.shape[-1]), q.scales.reshape(*lead, q.scales.shape[-1]),
                         q.outer.reshape(*lead, 1), q.fmt, False, dtype)


_DENSE = (("q", "self_attn.q_proj.weight"), ("k", "self_attn.k_proj.weight"), ("v", "self_attn.v_proj.weight"),
          ("o", "self_attn.o_proj.weight"), ("sg", "mlp.shared_expert.gate_proj.weight"),
          ("su", "mlp.shared_expert.up_proj.weight"), ("sd", "mlp.shared_expert.down_proj.weight"),
          ("mg", "mlp.gate_proj.weight"), ("mu", "mlp.up_proj.weight"), ("md", "mlp.down_proj.weight"))


def _prepare_layer(weights, i: int) -> tuple[dict, object]:
    """Layer i's weights in the kernels' layouts: (dense projections by path key, routed experts or None)."""
    from kernels.gemm import prepare_weight
    from kernels.moe import prepare_moe_weights

    experts = _expert_fp4(weights, i)
    dense = {key: prepare_weight(t.codes, t.scales, t.outer) for key, t in _dense_fp4(weights, i).items()}
    return dense, None if experts is None else prepare_moe_weights(*experts)


def _dense_fp4(weights, i: int) -> dict:
    """Layer i's dense FP4 weights (attention projections, shared-expert and dense MLPs) by path key."""
    pre = f"model.layers.{i}."
    return {key: weights.fp4[pre + sfx] for key, sfx in _DENSE if pre + sfx in weights.fp4}


def _expert_fp4(weights, i: int):
    """Layer i's routed experts as (gate, up, down) FP4Tensors, or None (no MoE in that layer)."""
    pre = f"model.layers.{i}."
    gu = weights.fp4.get(pre + "mlp.experts.gate_up_proj")
    if gu is None:
        return None
    inter = gu.codes.shape[1] // 2
    gate = fp4.FP4Tensor(gu.codes[:, :inter].contiguous(), gu.scales[:, :inter].contiguous(), gu.outer)
    up = fp4.FP4Tensor(gu.codes[:, inter:].contiguous(), gu.scales[:, inter:].contiguous(), gu.outer)
    return gate, up, weights.fp4[pre + "mlp.experts.down_proj"]  # gate and up share the per-expert outer scale
