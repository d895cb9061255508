"""FP4 quantization-aware training form of a Hugging Face MoE model, patched in place.

`patch_model(model, mode, fmt)` keeps every parameter name, dtype and the master weights: it swaps
the classes of the attention / MLP linears and the routers for subclasses with the same state,
registers an attention function (K/V fake-quant after norm and RoPE) and an experts function
(per-expert weight quant, per-token gate/up input, per-(token, slot) down input), and points the
model config at them. Modes: bf16 (bit-identical to the unpatched model), w4a16, w4a4, w4a4kv4.

The fake-quant sites and what they do at run time are driven by one `QATRuntime` per model:
- plain: RTN fake quant with a straight-through gradient (qat-independent);
- `recording(model, recorder, seq, pos)`: a forward fills a guidance record (any numerics);
- `replay(model, record, seq, pos, ...)`: guided rounding at the record's layers, routing replay,
  flip statistics and the alignment loss (TRACE).

    model = build_model("qwen3_moe-tiny"); patch_model(model, "w4a4kv4")
    with replay(model, record, seq, pos) as st:
        loss = model(ids).logits... + st.alignment_loss()

Weights are quantized by `quantize_weight`, the one function the rollout engine also calls.
Compared against: the unpatched transformers forward (bf16 mode, bit-identical) and fp4.fake_quant.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kernels import reference as ref
from trace import fp4
from trace.guidance.record import GuidanceRecord, Recorder, RecordMismatch

MODES = ("bf16", "w4a16", "w4a4", "w4a4kv4")
ATTN_IMPL = "trace_qat_sdpa"
EXPERTS_IMPL = "trace_qat_eager"


# ----------------------------------------------------------------------------------------------
# The shared weight quantizer (trainer and rollout engine)
# ----------------------------------------------------------------------------------------------
def quantize_weight(w: torch.Tensor, fmt: str = "nvfp4") -> fp4.FP4Tensor:
    """FP4 weight in [out, in] (or [E, out, in]) orientation, blocks along `in`. Outer scale per
    tensor, per expert for 3-D expert weights (DESIGN.md §2). The rollout engine calls this too."""
    outer = "expert" if w.dim() == 3 else "tensor"
    return fp4.quantize(w.detach(), fmt, outer)


class _WeightSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, wq):
        return wq

    @staticmethod
    def backward(ctx, g):
        return g, None


def fake_quant_weight(w: torch.Tensor, fmt: str = "nvfp4") -> torch.Tensor:
    return _WeightSTE.apply(w, quantize_weight(w, fmt).dequantize(w.dtype))


# ----------------------------------------------------------------------------------------------
# Runtime state and statistics
# ----------------------------------------------------------------------------------------------
@dataclass
class LayerStats:
    elements: int = 0
    code_flips: int = 0  # own RTN code != rollout code (guided code when full codes absent)
    blocks: int = 0
    scale_flips: int = 0  # own block scale byte != recorded
    unrecoverable: int = 0  # guided code != recorded full code
    unrec_checked: int = 0  # elements whose recovery could be checked (records with full codes)
    routing_tokens: int = 0
    routing_flips: int = 0  # own top-k set != recorded set


@dataclass
class ReplayStats:
    layers: dict[int, LayerStats] = field(default_factory=dict)
    align_sum: torch.Tensor | None = None
    align_count: int = 0

    def layer(self, i: int) -> LayerStats:
        return self.layers.setdefault(i, LayerStats())

    def alignment_loss(self) -> torch.Tensor:
        """mean over flipped elements of dist(a, boundary on the rollout side)^2 (DESIGN.md §3)."""
        if self.align_sum is None or self.align_count == 0:
            return torch.zeros(())
        return self.align_sum / self.align_count

    def summary(self) -> dict[str, dict[int, float]]:
        out = {"code_flip_rate": {}, "scale_flip_rate": {}, "unrecoverable_rate": {}, "routing_flip_rate": {}}
        for i, s in sorted(self.layers.items()):
            if s.elements:
                out["code_flip_rate"][i] = s.code_flips / s.elements
            if s.unrec_checked:  # unknown (absent) when the record holds no full codes
                out["unrecoverable_rate"][i] = s.unrecoverable / s.unrec_checked
            if s.blocks:
                out["scale_flip_rate"][i] = s.scale_flips / s.blocks
            if s.routing_tokens:
                out["routing_flip_rate"][i] = s.routing_flips / s.routing_tokens
        return out


@dataclass
class QATRuntime:
    mode: str = "w4a4"
    fmt: str = "nvfp4"
    recorder: Recorder | None = None
    record: GuidanceRecord | None = None
    guide_layers: set[int] | None = None  # None: every layer the record has
    routing_replay: bool = True
    full_codes: bool = False  # guide with the recorded full codes (ablation) instead of mantissa bits
    align: bool = False
    stats: ReplayStats | None = None
    seq: torch.Tensor | None = None  # [Ntok] sequence id per flattened token row
    pos: torch.Tensor | None = None  # [Ntok] position per row, -1 for padding

    @property
    def weights(self) -> bool:
        return self.mode != "bf16"

    @property
    def acts(self) -> bool:
        return self.mode in ("w4a4", "w4a4kv4")

    @property
    def kv(self) -> bool:
        return self.mode == "w4a4kv4"

    def _address(self, n: int):
        if self.seq is None:
            raise RecordMismatch("recording/replay needs the batch addressing (seq, pos) of every token")
        if self.seq.numel() != n:
            raise RecordMismatch(f"batch has {n} token rows but the addressing has {self.seq.numel()}")
        valid = self.pos >= 0
        return self.seq, self.pos, valid

    def guided(self, layer: int) -> bool:
        return self.record is not None and (self.guide_layers is None or layer in self.guide_layers)

    def act(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        """Fake-quantize activation rows x [Ntok, *inner, K] at (layer, site)."""
        if self.recorder is not None and self.recorder.wants(layer):
            seq, pos, valid = self._address(x.shape[0])
            t = fp4.quantize(x.detach()[valid], self.fmt, "row")
            self.recorder.add(layer, site, t, seq[valid], pos[valid])
        if self.record is None or not self.record.has(layer, site):
            return fp4.fake_quant(x, self.fmt, "row")
        seq, pos, valid = self._address(x.shape[0])
        xv = x[valid]
        g = self.record.lookup(layer, site, seq[valid], pos[valid])
        own = fp4.quantize(xv.detach(), self.fmt, "row")
        rec_codes = self.record.lookup_codes(layer, site, seq[valid], pos[valid])
        use_guide = self.guided(layer)
        if use_guide and self.full_codes:
            if rec_codes is None:
                raise RecordMismatch("full-codes replay needs a record made with Recorder(full_codes=True)")
            # the full-codes ablation: the rollout's own operands, nothing left to recover
            qv = fp4.FP4Tensor(rec_codes, g.scales, g.outer, self.fmt, False, x.dtype)
            res = fp4.GuidedResult(qv, torch.zeros_like(rec_codes, dtype=torch.bool))
        elif use_guide:
            res = fp4.guided_quantize(xv.detach(), g.mantissa, g.scales, g.outer, self.fmt, ref_codes=rec_codes)
            qv = res.tensor
        if self.stats is not None:
            st = self.stats.layer(layer)
            st.elements += own.codes.numel()
            st.blocks += own.scales.numel()
            st.scale_flips += int((own.scales != g.scales).sum())
            target = rec_codes if rec_codes is not None else (qv.codes if use_guide else None)
            if target is not None:
                st.code_flips += int(((own.codes != target) & ((own.codes | target) & 7 != 0)).sum())
            if use_guide and res.unrecoverable is not None:
                st.unrecoverable += int(res.unrecoverable.sum())
                st.unrec_checked += res.unrecoverable.numel()
            if use_guide and self.align:
                self._alignment(xv, own, qv, g)
        if not use_guide:
            return fp4.fake_quant(x, self.fmt, "row")
        out = fp4.fake_quant(x, self.fmt, "row")  # RTN for padding rows
        guided_vals = fp4.tensor._STE.apply(xv, qv.dequantize(x.dtype))
        return out.index_put((valid.nonzero().squeeze(-1),), guided_vals) if not bool(valid.all()) else guided_vals

    def _alignment(self, xv, own, qv, g):
        """Squared distance of the trainer's scaled value to the grid midpoint it must cross to
        round like the rollout, for elements whose own RTN code (under the recorded scales)
        differs from the rollout's code."""
        scaled = (ref.nvfp4_scaled(xv, g.scales, g.outer) if self.fmt == "nvfp4"
                  else ref.mxfp4_scaled(xv, g.scales))
        a = scaled.abs()
        own_mag = ref.e2m1_encode(scaled.detach()).long() & 7
        tgt_mag = qv.codes.long() & 7
        flipped = own_mag != tgt_mag
        if not bool(flipped.any()):
            return
        grid = torch.tensor(ref.E2M1_GRID, device=xv.device)
        step = torch.where(tgt_mag > own_mag, 1, -1)
        nb = (own_mag + step).clamp(0, 7)
        boundary = (grid[own_mag] + grid[nb]) / 2
        d2 = (a - boundary)[flipped] ** 2
        s = d2.sum()
        self.stats.align_sum = s if self.stats.align_sum is None else self.stats.align_sum + s
        self.stats.align_count += int(flipped.sum())

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        return fake_quant_weight(w, self.fmt) if self.weights else w


def _rt(module) -> QATRuntime | None:
    return getattr(module, "_trace_rt", None)


# ----------------------------------------------------------------------------------------------
# Patched modules (same parameters, new forward)
# ----------------------------------------------------------------------------------------------
class QATLinear(nn.Linear):
    """nn.Linear whose input (site `_trace_site` of layer `_trace_layer`) and weight are FP4
    fake-quantized. q/k/v share one site: their common input is quantized identically."""

    def forward(self, x):
        rt = _rt(self)
        if rt is None or rt.mode == "bf16":
            return F.linear(x, self.weight, self.bias)
        if rt.acts:
            shape = x.shape
            x = rt.act(self._trace_layer, self._trace_site, x.reshape(-1, shape[-1])).reshape(shape)
        return F.linear(x, rt.weight(self.weight), self.bias)


class _SharedInputLinear(QATLinear):
    """Projections reading one input (q/k/v; gate/up): it is quantized once per forward and shared."""

    def forward(self, x):
        rt = _rt(self)
        if rt is None or rt.mode == "bf16" or not rt.acts:
            return super().forward(x)
        cache = self._trace_cache
        if cache.get("src") is not x:
            shape = x.shape
            cache["src"] = x
            cache["q"] = rt.act(self._trace_layer, self._trace_site, x.reshape(-1, shape[-1])).reshape(shape)
        return F.linear(cache["q"], rt.weight(self.weight), self.bias)


def _router_forward_factory(orig_cls):
    class ReplayRouter(orig_cls):
        """Router with routing replay: the rollout's expert ids, with weights recomputed from this
        forward's router logits so the router still trains."""

        def forward(self, hidden_states):
            logits, scores, idx = orig_cls.forward(self, hidden_states)
            rt = _rt(self)
            if rt is None:
                return logits, scores, idx
            layer = self._trace_layer
            if rt.recorder is not None and rt.recorder.wants(layer):
                seq, pos, valid = rt._address(idx.shape[0])
                rt.recorder.add_routing(layer, idx[valid], seq[valid], pos[valid])
            if rt.record is None or not rt.routing_replay or layer not in rt.record.routing:
                return logits, scores, idx
            seq, pos, valid = rt._address(idx.shape[0])
            rec_idx = idx.clone()
            rec_idx[valid] = rt.record.lookup_routing(layer, seq[valid], pos[valid]).to(idx.device)
            if rt.stats is not None:
                st = rt.stats.layer(layer)
                st.routing_tokens += int(valid.sum())
                same = (idx[valid].sort(-1).values == rec_idx[valid].sort(-1).values).all(-1)
                st.routing_flips += int((~same).sum())
            probs = torch.softmax(logits.float(), dim=-1)
            w = probs.gather(1, rec_idx)
            if getattr(self, "norm_topk_prob", True):  # Mixtral's router always renormalizes
                w = w / w.sum(-1, keepdim=True)
            return logits, w.to(scores.dtype), rec_idx

    ReplayRouter.__name__ = orig_cls.__name__
    ReplayRouter.__qualname__ = orig_cls.__qualname__
    return ReplayRouter


_ROUTER_CLASSES: dict[type, type] = {}


def trace_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Eager expert loop with FP4 sites. hidden_states [N, H], top_k_index/weights [N, k]."""
    rt = _rt(self)
    if rt is None or rt.mode == "bf16":
        return type(self).__mro__[0].forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    layer = self._trace_layer
    n, k = top_k_index.shape
    x = rt.act(layer, "moe_in", hidden_states) if rt.acts else hidden_states  # [N, H] per token
    w_gu = rt.weight(self.gate_up_proj)  # [E, 2I, H]
    w_d = rt.weight(self.down_proj)  # [E, H, I]
    inter = w_d.shape[-1]
    mask = F.one_hot(top_k_index, self.num_experts).permute(2, 1, 0)  # [E, k, N]
    hit = (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
    pairs, h_all = {}, None
    for e in hit:
        slot, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], w_gu[e]).chunk(2, dim=-1)
        h = self.act_fn(gate) * up  # [n_e, I] (bf16 under autocast)
        if h_all is None:
            h_all = h.new_zeros(n, k, inter)  # [N, k, I]: the down input per (token, slot)
        h_all = h_all.index_put((tok, slot), h)
        pairs[e] = (slot, tok)
    if h_all is None:
        return torch.zeros_like(hidden_states)
    if rt.acts:
        h_all = rt.act(layer, "moe_down_in", h_all)
    out = torch.zeros_like(hidden_states)
    for e, (slot, tok) in pairs.items():
        y = F.linear(h_all[tok, slot], w_d[e]) * top_k_weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def trace_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA with K (after norm and RoPE) and V fake-quantized per token and head."""
    rt = _rt(module)
    if rt is not None and rt.kv:
        layer = module._trace_layer
        key, value = (_kv_quant(rt, layer, site, x, query.shape[2]) for site, x in (("k", key), ("v", value)))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _kv_quant(rt: QATRuntime, layer: int, site: str, x: torch.Tensor, t_new: int) -> torch.Tensor:
    """x [B, H_kv, T_kv, D]: quantize per (token, head). With a KV cache (HF generate) only the
    newest t_new rows belong to this forward's tokens; the cached rows are re-quantized plainly,
    which gives them the same values they had when they were new (RTN is deterministic)."""
    b, h, t, d = x.shape
    rows = x.transpose(1, 2)  # [B, T_kv, H_kv, D]
    new = rt.act(layer, site, rows[:, t - t_new:].reshape(b * t_new, h, d)).reshape(b, t_new, h, d)
    if t > t_new:
        new = torch.cat([fp4.fake_quant(rows[:, : t - t_new], rt.fmt, "row"), new], dim=1)
    return new.transpose(1, 2)


AttentionInterface.register(ATTN_IMPL, trace_attention)
AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)
ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPL, trace_experts_forward)


def _swap(module: nn.Module, cls: type, rt: QATRuntime, layer: int, site: str | None = None):
    module.__class__ = cls
    module._trace_rt = rt
    module._trace_layer = layer
    if site is not None:
        module._trace_site = site


def _swap_shared(linears, rt, layer, site):
    """Linears that read the same input (q/k/v, gate/up) quantize and record it once."""
    cache: dict = {}
    for lin in linears:
        _swap(lin, _SharedInputLinear, rt, layer, site)
        lin._trace_cache = cache


def patch_model(model: nn.Module, mode: str = "w4a4", fmt: str = "nvfp4") -> QATRuntime:
    """Patch a transformers MoE causal LM in place; returns its runtime (also `model._trace_rt`).
    Calling it again changes the mode of an already patched model."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if fmt not in fp4.FORMATS:
        raise ValueError(f"fmt must be one of {fp4.FORMATS}, got {fmt!r}")
    if getattr(model, "_trace_rt", None) is not None:
        model._trace_rt.mode, model._trace_rt.fmt = mode, fmt
        return model._trace_rt
    rt = QATRuntime(mode=mode, fmt=fmt)
    if model.config._attn_implementation != "sdpa":
        raise ValueError("patch_model expects attn_implementation='sdpa' (the registry default)")
    layers = model.model.layers
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        _swap_shared([attn.q_proj, attn.k_proj, attn.v_proj], rt, i, "attn_in")
        _swap(attn.o_proj, QATLinear, rt, i, "o_in")
        attn._trace_rt, attn._trace_layer = rt, i
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            mlp.experts._trace_rt, mlp.experts._trace_layer = rt, i
            gate = mlp.gate
            cls = _ROUTER_CLASSES.setdefault(type(gate), _router_forward_factory(type(gate)))
            _swap(gate, cls, rt, i)
            shared = getattr(mlp, "shared_expert", None)
            if shared is not None:
                _swap_shared([shared.gate_proj, shared.up_proj], rt, i, "shared_in")
                _swap(shared.down_proj, QATLinear, rt, i, "shared_down_in")
        else:  # a dense MLP layer
            _swap_shared([mlp.gate_proj, mlp.up_proj], rt, i, "mlp_in")
            _swap(mlp.down_proj, QATLinear, rt, i, "mlp_down_in")
    model.config._attn_implementation = ATTN_IMPL
    model.config._experts_implementation = EXPERTS_IMPL
    model._trace_rt = rt
    return rt


def _flat_address(seq: torch.Tensor, pos: torch.Tensor):
    """seq [B], pos [B, T] (-1 = padding) -> per flattened token row."""
    if pos.dim() != 2 or seq.dim() != 1 or seq.shape[0] != pos.shape[0]:
        raise RecordMismatch(f"addressing must be seq [B] and pos [B, T], got {tuple(seq.shape)} and {tuple(pos.shape)}")
    return seq[:, None].expand_as(pos).reshape(-1), pos.reshape(-1)


@contextlib.contextmanager
def recording(model, recorder: Recorder, seq: torch.Tensor, pos: torch.Tensor):
    """Within the block, forwards of `model` fill `recorder` at every site they quantize (and the
    routing of every MoE layer). seq [B] sequence ids, pos [B, T] positions (-1 for padding)."""
    rt = model._trace_rt
    old = (rt.recorder, rt.seq, rt.pos)
    rt.recorder = recorder
    rt.seq, rt.pos = _flat_address(seq, pos)
    try:
        yield recorder
    finally:
        rt.recorder, rt.seq, rt.pos = old


@contextlib.contextmanager
def replay(model, record: GuidanceRecord, seq: torch.Tensor, pos: torch.Tensor, *, guide: bool = True,
           guide_layers=None, routing: bool = True, align: bool = False, full_codes: bool = False):
    """Within the block, forwards use guided rounding at the record's layers (or `guide_layers`),
    routing replay, and collect flip statistics / the alignment loss into the yielded ReplayStats.
    guide=False measures flips against the record without guiding (the unguided arms).
    full_codes=True guides with the recorded 4-bit codes themselves (the full-codes ablation; the
    record must hold them); otherwise full codes in a record only serve the statistics."""
    rt = model._trace_rt
    old = (rt.record, rt.guide_layers, rt.routing_replay, rt.align, rt.full_codes, rt.stats, rt.seq, rt.pos)
    stats = ReplayStats()
    rt.record = record
    rt.guide_layers = (set() if not guide else (None if guide_layers is None else set(guide_layers)))
    rt.routing_replay, rt.align, rt.full_codes, rt.stats = routing, align, full_codes, stats
    rt.seq, rt.pos = _flat_address(seq, pos)
    try:
        yield stats
    finally:
        rt.record, rt.guide_layers, rt.routing_replay, rt.align, rt.full_codes, rt.stats, rt.seq, rt.pos = old


def guided_layer_indices(num_layers: int, rho: float) -> list[int]:
    """The deepest fraction rho of the layers (DESIGN.md §3): rho=0 -> none, 1 -> all."""
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [0, 1], got {rho}")
    n = int(round(rho * num_layers))
    return list(range(num_layers - n, num_layers))
