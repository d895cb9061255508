"""The rollout engine's own forward for the four MoE families (torch reference path, CPU or GPU).

What: `EngineForward.__call__(ids [R, T], start [R], lens [R], rows, cache, rec)` runs a ragged chunk:
row r feeds `lens[r]` new tokens at absolute positions start[r] .. start[r]+lens[r]-1 (right padding
up to T), writes their K/V into cache row `rows[r]` and attends to that row's slots <= its position.
The same function does the batched prefill (many prompts of mixed lengths, per-row positions, no left
padding), the one-token decode steps and the multi-token environment-observation chunks of multi-turn
generation. It is written from trace/models/FAMILIES.md, not by calling the HF modules:

    h = x + o_proj(attn(rope(qk_norm(q, k)), v))      # q/k norm per head (qwen3_moe), full-width (olmoe)
    y = h + moe(rmsnorm(h))                            #   or none; q/k/v/o biases where the weights have them
    moe: softmax(router, fp32) -> top-k -> [renorm] -> per-expert gate_up / silu*up / down,
         weighted sum over the k slots; with a shared expert + sigmoid(shared_gate(x)) * shared_expert(x)

The family quirks (q/k norm kind, renormalization, routing-weight dtype, shared expert) come from the
family's descriptor through `Arch` (trace/models/registry.py FamilyInfo), never from its name.

Modes: `bf16` (no quantization, any dtype) and `w4a4` (dequantized FP4 weights from EngineWeights;
activations per-token RTN via `trace.fp4.quantize(x, fmt, "row")` at attn_in, o_in, moe_in,
moe_down_in [N, k, I], shared_in, shared_down_in, mlp_in, mlp_down_in); FP4 KV in the cache (sites k, v).
Decode order differs from the trainer on purpose (incremental, chunked, own MoE reduction order).

Recording: with `rec` (a `trace.guidance.Recording`: recorder + row addressing) given, each quantized
site calls `rec.add(layer, site, FP4Tensor of the chunk's rows)` and MoE layers `rec.add_routing`, the
same calls and site names as the trainer's adapter (trace/guidance/replay.py). On the Triton path the
kernels hand their own activation codes to `rec` (TritonPath `keep` callbacks), for the layers the
recorder wants only; above the kernels' crossover (`TritonPath.dense_kernels` / `moe_kernels`) and in
prefill and multi-token chunks (`fast.ChunkPath`) the quantize kernel's codes feed BF16 GEMMs on the
dequantized weights and are recorded the same way. Without `rec` nothing extra is computed.

Batch-invariant mode (`bi`, the engine's `batch_invariant`, DESIGN.md §4 "Exact on-policy arm"): every chunk, prefill
or decode, on the Triton path's kernels in the configs of `kernels.batch_invariant` (FP4 projections and experts at
any row count, attention by `TritonPath.attend`, router / shared gate / lm_head by its fixed-tile GEMM, the fused
norms and routing, RoPE from one table), so a token's row has the same bits in a decode step and in a full-sequence
forward of the same tokens.

Compared against: the transformers forward (bf16 mode) and `trace.qat.patch_model(model, "w4a4")`
(w4a4 mode) in tests/rollout/test_engine.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from trace.guidance import Recording
from trace.rollout.cache import KVCache, quant_rows
from trace.rollout.fast import CHUNK, as_fp4, observer
from trace.rollout.weights import EngineWeights


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [M, K] rows sorted by group, w [G, K, N], offs [G] int32 cumulative row ends -> [M, N].
    torch's grouped GEMM (CUTLASS on Hopper, a loop of mm on the CPU), as transformers'
    `grouped_mm` experts implementation calls it."""
    if x.is_cuda and x.dtype != torch.bfloat16:  # the CUDA kernel is bf16-only: loop (host sync, eager only)
        out, lo = x.new_empty(x.shape[0], w.shape[-1]), 0
        for g, hi in enumerate(offs.tolist()):
            out[lo:hi] = x[lo:hi] @ w[g]
            lo = hi
        return out
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(x, w, offs=offs)


def routed_experts(x: torch.Tensor, topi: torch.Tensor, topv: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor,
                   quant_in, quant_down) -> torch.Tensor:
    """The routed experts on grouped GEMMs: x [N, H], top-k ids topi [N, k] (int64) and weights topv [N, k],
    wgu [E, 2I, H] (gate | up), wd [E, H, I]; quant_in(x) / quant_down(h [N, k, I]) return the activation
    as the GEMM reads it (the FP4 fake quantization, or x itself). -> [N, H] in x's dtype."""
    N, H = x.shape
    k, E, I = topi.shape[1], wd.shape[0], wd.shape[-1]
    xq = quant_in(x)  # per token, shared by its k experts
    # (token, slot) pairs sorted by expert -> one grouped GEMM per projection, no host sync (so decode
    # steps can be captured in a CUDA graph): counts by scatter_add, not bincount (which syncs on CUDA)
    flat = topi.reshape(-1)  # [N*k] expert of each (token, slot) pair
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)  # [E] end row of each expert's group
    gate, up = grouped_mm(xq[order // k], wgu.transpose(1, 2), offs).chunk(2, dim=-1)  # [N*k, I] each, sorted
    h = torch.empty_like(gate)
    h[order] = F.silu(gate) * up  # back to (token, slot) order: the down input is quantized per pair
    h = quant_down(h.view(N, k, I)).reshape(N * k, I)
    y = torch.empty(N * k, H, dtype=h.dtype, device=x.device)
    y[order] = grouped_mm(h[order], wd.transpose(1, 2), offs)  # [N*k, H]
    return (y.view(N, k, H) * topv[..., None]).to(x.dtype).sum(1)  # [N, H]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: float32 statistics, cast back, then weight * x."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t [..., Hh, D], cos / sin [..., D] -> t * cos + rotate_half(t) * sin, the same angles for every head
    (transformers' `apply_rotary_pos_emb` on one tensor; `kernels.norm.norm_rope` makes the same roundings)."""
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [..., 1, D]
    return t * c + rotate_half(t) * s


class EngineForward:
    def __init__(self, w: EngineWeights, *, mode: str, fmt: str, dtype: torch.dtype):
        self.w, self.a, self.mode, self.fmt, self.dtype = w, w.arch, mode, fmt, dtype
        self.acts = mode == "w4a4"
        self.fast = None  # TritonPath (trace/rollout/fast.py) when enabled by the engine
        self.fused = False  # kernels/norm.py and kernels/routing.py for the norms, RoPE, routing (`fast.fused_ops`)
        # batch-invariant mode (the engine's `batch_invariant`; needs `fast` with its `bi` on and `fused`): every
        # chunk, prefill or decode, on the same kernels in the same configs, so a token's row gives the same bits in
        # a decode step and in a full-sequence forward (DESIGN.md §4 "Exact on-policy arm")
        self.bi = False
        self._rope_table = None  # batch-invariant mode: cos, sin [positions, D] computed once

    # ------------------------------------------------------------------------------ helpers
    def _norm(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None):
        """rms_norm(x) or, with residual, (s, rms_norm(s)) for s = x + residual: one launch of `kernels.norm` when
        enabled (the same roundings; the inverse RMS to its last float32 bits), else the torch ops."""
        if self.fused:
            from kernels.norm import rms_norm as fused

            return fused(x, w, self.a.eps, residual)
        if residual is None:
            return rms_norm(x, w, self.a.eps)
        s = x + residual
        return s, rms_norm(s, w, self.a.eps)

    def _rope_heads(self, t: torch.Tensor, cos, sin, w: torch.Tensor | None) -> torch.Tensor:
        """t [R, T, Hh, D] -> RoPE(per-head rms_norm_w(t)) (the norm only with w, Qwen3's q/k norm); cos, sin [R, T, D]."""
        if self.fused:
            from kernels.norm import norm_rope

            R, T, Hh, D = t.shape
            return norm_rope(t.reshape(R * T, Hh, D), cos.reshape(R * T, D), sin.reshape(R * T, D), w,
                             self.a.eps).view(R, T, Hh, D)
        if w is not None:
            t = rms_norm(t, w, self.a.eps)
        return rope(t, cos, sin)

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """An unquantized linear (router, shared-expert gate, lm_head): F.linear, or the batch-invariant mode's."""
        return self.fast.plain_linear(x, w) if self.bi else F.linear(x, w)

    def _sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return self.fast.sigmoid(x) if self.bi else torch.sigmoid(x)

    def _act(self, x: torch.Tensor, layer: int, site: str, rec: Recording | None) -> torch.Tensor:
        """Per-row FP4 RTN of x [N, *inner, K] at (layer, site); returns the dequantized value."""
        if not self.acts:
            return x
        t = quant_rows(x, self.fmt)
        if rec is not None:
            rec.add(layer, site, t)
        return t.dequantize(self.dtype)

    def _act_fast(self, x: torch.Tensor, layer: int, site: str, rec: Recording | None) -> torch.Tensor:
        """`_act` on the Triton path above its kernels' sizes: the quantize kernel's codes (the same as
        `_act`'s, recorded as the kernels' are) and its dequantized copy (within an ulp of `_act`'s; the
        W4A4 decode kernels read the same, `kernels.quantize.fake_rows`), for a BF16 GEMM."""
        from trace.fp4.rows import fake_rows

        keep = self._keep(rec, layer, site, tuple(x.shape[1:-1]))
        seen = observer(keep, self.dtype, tuple(x.shape[:-1]))
        return fake_rows(x.reshape(-1, x.shape[-1]), seen).view(x.shape)

    def _acts(self, fast):
        """The activation quantizer of a chunk: `_act`, or on the Triton path `_act_fast`."""
        return self._act if fast is None else self._act_fast

    @staticmethod
    def _keep(rec: Recording | None, layer: int, site: str, inner: tuple = ()):
        """The fast path's callback that stores an activation's FP4Tensor at (layer, site), or None when
        nothing records that layer (the kernels then skip handing the codes out). A recorded decode step's
        `StepRecording` gives its record sink instead (inner: the site's dims between rows and K), which the
        quantize launch writes itself."""
        if rec is None or not rec.wants(layer):
            return None
        sink = getattr(rec, "sink", None)
        s = None if sink is None else sink(layer, site, inner)
        return s if s is not None else (lambda t: rec.add(layer, site, t))

    @staticmethod
    def _kv_sinks(rec, layer: int, heads: int):
        """(sink of k, sink of v) of a recorded decode step's StepRecording for the FP4-KV store, or None."""
        sink = getattr(rec, "sink", None)
        if sink is None:
            return None
        ks = tuple(sink(layer, site, (heads,)) for site in ("k", "v"))
        return None if None in ks else ks

    @staticmethod
    def _record_kv(rec: Recording, layer: int, kv4) -> None:
        """kv4: the FP4Tensors of K and V, [R*T, H_kv, D] each."""
        for site, t in zip(("k", "v"), kv4, strict=True):
            rec.add(layer, site, t)

    def _rope(self, pos: torch.Tensor):
        """cos, sin [R, T, D] for absolute positions pos [R, T] (float32 like transformers, then dtype). In the
        batch-invariant mode rows of one table made once for every position (a CPU's vectorized cos / sin and its
        scalar remainder loop may differ in the last bit, and the remainder follows the tensor's size)."""
        if self.bi:
            p = pos.clamp(0, self.a.max_pos - 1)  # padding past the context: never used
            return self._rope_table[0][p], self._rope_table[1][p]
        return self._rope_of(pos)

    def batch_invariant(self) -> None:
        """Switch this forward to the batch-invariant mode (its `fast` path built with `batch_invariant`): the fused
        ops on, and the RoPE table made now, eagerly, before any decode graph captures a step."""
        self.bi, self.fused = True, True
        pos = torch.arange(self.a.max_pos, device=self.w.embed.device)[None]
        self._rope_table = tuple(t[0] for t in self._rope_of(pos))

    def _rope_of(self, pos: torch.Tensor):
        freqs = pos.float()[..., None] * self.w.inv_freq  # [R, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    # ------------------------------------------------------------------------------ blocks
    def _attention(self, i, lw, x, cos, sin, slots, start, lens, rows, cache: KVCache, rec, S: int, causal: bool,
                   fast):
        a = self.a
        R, T, _ = x.shape
        nh, nkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        kern = fast is not None and fast.dense_kernels(R * T)
        act = self._acts(fast)
        if kern:  # W4A4 Triton GEMMs (activation quantized inside, same codes; q's is recorded)
            x2 = x.reshape(R * T, -1)
            q = fast.linear(i, "q", x2, lw.get("q_b"), keep=self._keep(rec, i, "attn_in"))
            k, v = (fast.linear(i, n, x2, lw.get(n + "_b")) for n in ("k", "v"))
        else:
            xq = act(x.reshape(R * T, -1), i, "attn_in", rec)  # [R*T, H], one quantization for q/k/v
            q = F.linear(xq, lw["q"], lw.get("q_b"))  # [R*T, nh*D]
            k = F.linear(xq, lw["k"], lw.get("k_b"))  # [R*T, nkv*D]
            v = F.linear(xq, lw["v"], lw.get("v_b"))
        if a.qk_norm == "full":  # q/k norm over the whole projection, before the head split (OLMoE)
            q = self._norm(q, lw["q_norm"])
            k = self._norm(k, lw["k_norm"])
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        per_head = a.qk_norm == "per_head"  # per-head q/k norm, then RoPE (Qwen3-MoE)
        q = self._rope_heads(q.view(R, T, nh, D), cos, sin, lw["q_norm"] if per_head else None)
        k = self._rope_heads(k.view(R, T, nkv, D), cos, sin, lw["k_norm"] if per_head else None)
        v = v.view(R, T, nkv, D)
        if self.bi:  # every chunk: each query one program of the decode kernel (fast.TritonPath.attend)
            o = fast.attend(cache, i, rows, slots, start, lens, q, k, v, S).reshape(R * T, nh * D)
            if rec is not None and rec.wants(i):
                self._record_kv(rec, i, cache.stored(i, rows, slots))
        elif fast is not None and cache.codes_stored and T == 1 and cache.fmt == "nvfp4":  # FP4-KV decode kernel
            kv_rec = self._kv_sinks(rec, i, nkv)  # a recorded step: the store's launches write the K/V record
            o = fast.decode_attention(cache, i, rows, slots, start, lens, q, k, v, S, record=kv_rec)
            o = o.reshape(R * T, nh * D)
            if rec is not None and rec.wants(i) and kv_rec is None:  # the K/V codes the kernel stored, read back
                self._record_kv(rec, i, cache.stored(i, rows, slots))
        else:
            o = self._cached_attention(i, q, k, v, slots, start, lens, rows, cache, rec, S, causal, fast)
        if kern:
            return fast.linear(i, "o", o, lw.get("o_b"), keep=self._keep(rec, i, "o_in")).view(R, T, -1)
        o = act(o, i, "o_in", rec)
        return F.linear(o, lw["o"], lw.get("o_b")).view(R, T, -1)

    def _cached_attention(self, i, q, k, v, slots, start, lens, rows, cache: KVCache, rec, S: int, causal: bool,
                          fast=None):
        """q [R, T, nh, D], k/v [R, T, nkv, D] (after norm + RoPE): store k/v in the cache (recording their
        FP4 codes), attend over the row's slots <= its positions -> o [R*T, nh*D]. A decode step's idle row
        (lens 0, feeding nothing) attends over its cached tokens only (slots < start)."""
        R, T, nh, D = q.shape
        nkv = k.shape[2]
        if causal and fast is CHUNK and cache.codes_stored and cache.fmt == "nvfp4":
            # a fresh prefill attends to exactly what it stores (S == T): the kernel's exact dequantized
            # copy, the values a read of the cache would decode (padded positions, never attended by a
            # valid one under the causal mask, hold their own values instead of the trash slot's)
            kd, vd, qs = fast.prefill_kv(cache, i, rows, slots, k, v)
            if rec is not None and rec.wants(i):
                self._record_kv(rec, i, [as_fp4(qq, cache.dtype, (R * T, nkv)) for qq in qs])
            kc, vc = kd.transpose(1, 2), vd.transpose(1, 2)  # [R, nkv, S, D]
        else:
            kv4 = cache.write(i, rows, slots, k, v)
            if kv4 is not None and rec is not None:
                self._record_kv(rec, i, kv4)
            kc, vc = cache.read(i, rows, S)  # [R, nkv, S, D]
        if T == 1:  # decode: one SDPA call with GQA (no K/V copy), the mask the row's length. At B256 x 1k it took
            # 147 us against 207 for the KV heads' query rows as one attention each and 139 unmasked (H200); grouped
            # matmuls, mask and softmax took the engine's attention to 2.60 ms per step (kernels/NOTES.md, "The engine's
            # decode step")
            # [R, S]; an idle row's slot `start` may hold a token of a step that did not count for it (a
            # launched-ahead step run again without it: decode.SingleTurnLoop), never read
            keep = torch.arange(S, device=q.device)[None, :] < (start + lens)[:, None]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kc, vc, attn_mask=keep[:, None, None, :],
                                               enable_gqa=True)  # [R, nh, 1, D]
        elif causal:  # fresh prefill: every row starts at 0 and S == T, so the causal mask is the whole mask
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kc, vc, is_causal=True, enable_gqa=True)
        else:  # chunk appended at per-row offsets (environment observations)
            qpos = start[:, None] + torch.arange(T, device=q.device)  # [R, T]
            mask = torch.arange(S, device=q.device)[None, None, :] <= qpos[:, :, None]  # [R, T, S]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kc, vc, attn_mask=mask[:, None], enable_gqa=True)
        return o.transpose(1, 2).reshape(R * T, nh * D) if T > 1 else o.reshape(R, nh * D)

    def _moe(self, i, lw, x, rec, fast):
        """x [N, H] (normed) -> [N, H]."""
        a = self.a
        N = x.shape[0]
        k = a.top_k
        logits = self._linear(x, lw["router"])  # [N, E], unquantized router
        wdt = torch.float32 if a.routing_fp32 else x.dtype  # Mixtral keeps its routing weights float32
        if self.fused:
            from kernels.routing import topk_softmax

            topv, topi = topk_softmax(logits, k, a.renorm, wdt)
        else:
            probs = torch.softmax(logits.float(), dim=-1)
            topv, topi = torch.topk(probs, k, dim=-1)  # [N, k], slot order = top-k order
            if a.renorm:
                topv = topv / topv.sum(-1, keepdim=True)
            topv = topv.to(wdt)
        if rec is not None:
            rec.add_routing(i, topi)
        if fast is not None and fast.moe_kernels(i, N, k):
            out = fast.experts(i, x, topi, topv, keep_in=self._keep(rec, i, "moe_in"),
                               keep_down=self._keep(rec, i, "moe_down_in", (k,)))  # [N, H] W4A4 grouped expert GEMMs
        else:
            act = self._acts(fast)
            out = routed_experts(x, topi, topv, lw["gate_up"], lw["down"], lambda t: act(t, i, "moe_in", rec),
                                 lambda t: act(t, i, "moe_down_in", rec))
        if a.shared_expert:  # Qwen2-MoE's shared expert, gated by a per-token sigmoid of the unquantized input
            sd = self._mlp(i, lw, x, rec, fast, ("sg", "su", "sd"), ("shared_in", "shared_down_in"))
            out = out + self._sigmoid(self._linear(x, lw["shared_gate"])) * sd
        return out

    def _mlp(self, i, lw, x, rec, fast, keys, sites):
        """Gated MLP down(silu(gate(x)) * up(x)) with the weights `keys` (gate, up, down), x [N, H]; the
        input's and the down input's codes recorded at `sites`. W4A4 kernels on the Triton path up to their
        sizes, else BF16 GEMMs on the dequantized weights."""
        g, u, d = keys
        if fast is not None and fast.dense_kernels(x.shape[0]):
            gl, ul = fast.linear(i, g, x, keep=self._keep(rec, i, sites[0])), fast.linear(i, u, x)
            hs = fast.silu_mul(gl, ul) if self.bi else F.silu(gl) * ul
            return fast.linear(i, d, hs, keep=self._keep(rec, i, sites[1]))
        act = self._acts(fast)
        xs = act(x, i, sites[0], rec)
        hs = F.silu(F.linear(xs, lw[g])) * F.linear(xs, lw[u])  # [N, I]
        return F.linear(act(hs, i, sites[1], rec), lw[d])

    def _dense_mlp(self, i, lw, x, rec, fast):
        return self._mlp(i, lw, x, rec, fast, ("mg", "mu", "md"), ("mlp_in", "mlp_down_in"))

    # ------------------------------------------------------------------------------ chunk
    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, start: torch.Tensor, lens: torch.Tensor, rows, cache: KVCache,
                 rec: Recording | None = None, all_logits: bool = False, max_len: int | None = None,
                 causal: bool = False, streams: list | None = None) -> torch.Tensor:
        """ids [R, T] long (padded), start/lens [R] long; max_len = max(start + lens) (host int, optional;
        a decode step may pass more: slots past a row's position are masked). causal: the caller knows
        every row starts at 0 and max_len == T (a fresh prefill), so attention needs only the causal mask.
        Returns logits [R, V] at each row's last fed token (or [R, T, V] with all_logits). streams (a list, with
        all_logits): gets the residual stream [R, T, H] entering each layer and the final norm's input (L + 1)."""
        S = int((start + lens).max()) if max_len is None else max_len
        w = self.w
        R, T = ids.shape
        t = torch.arange(T, device=ids.device)
        pos = start[:, None] + t  # [R, T] absolute positions
        valid = t[None, :] < lens[:, None]  # [R, T]
        slots = torch.where(valid, pos, torch.full_like(pos, cache.cap))  # padding -> trash slot
        cos, sin = self._rope(pos)
        # FP4 GEMM kernels (kernels/) for decode steps only: they stream FP4 weights, which pays when a step
        # is memory-bound; prefill and multi-token chunks are compute-bound and run the same codes on BF16
        # tensor cores (dequantized weights), quantized by the Triton quantize kernel (`fast.ChunkPath`)
        fast = self.fast if T == 1 or self.fast is None or self.bi else CHUNK
        x = F.embedding(ids, w.embed)  # [R, T, H] residual stream
        h = self._norm(x, w.layers[0]["ln1"])
        for i, lw in enumerate(w.layers):
            if streams is not None:
                streams.append(x)
            # profiler labels (no-ops unless torch.profiler is active): benchmarks/bench_rollout.py
            # --breakdown splits step time into attention / moe / other with them
            with record_function("rollout.attention"):
                att = self._attention(i, lw, h, cos, sin, slots, start, lens, rows, cache, rec, S, causal, fast)
            x, h = self._norm(x, lw["ln2"], residual=att)  # x += att; h = norm(x)
            h = h.reshape(R * T, -1)  # [N, H]
            with record_function("rollout.moe"):
                m = self._moe(i, lw, h, rec, fast) if "gate_up" in lw else self._dense_mlp(i, lw, h, rec, fast)
            m = m.view(R, T, -1)
            if i + 1 < len(w.layers):  # the add into the stream fused with the next layer's norm
                x, h = self._norm(x, w.layers[i + 1]["ln1"], residual=m)
        if not all_logits:  # the last layer's add on the last fed tokens only, [R, H]
            last = (torch.arange(R, device=ids.device), lens - 1)
            x, m = x[last], m[last]
        x, h = self._norm(x, w.norm, residual=m)
        if streams is not None:
            streams.append(x)
        return self._linear(h, w.lm_head)
