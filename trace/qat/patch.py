"""The Hugging Face adapter of TRACE: an FP4 quantization-aware training form of a transformers MoE
model, patched in place.

`patch_model(model, mode, fmt)` keeps every parameter name, dtype and the master weights: it swaps
the classes of the attention / MLP linears and the routers for subclasses with the same state,
registers an attention function (K/V fake-quant after norm and RoPE) and an experts function
(per-expert weight quant, per-token gate/up input, per-(token, slot) down input), and points the
model config at them. Modes: bf16 (bit-identical to the unpatched model on the experts' loop; on the grouped path,
trace/qat/experts.py, up to float summation order in the backward), w4a16, w4a4, w4a4kv4.

This file only decides WHICH tensors are quantized at which site (SITES in trace/guidance/record.py).
What happens there is the guidance runtime's (trace/guidance/replay.py): plain RTN fake quant with a
straight-through gradient (qat-independent), recording, or replay (guided rounding, routing replay,
flip statistics, alignment term: TRACE). Weights go through `fp4.fake_quant_weight`, the quantizer
the rollout engine uses too.

    model = build_model("qwen3_moe-tiny"); patch_model(model, "w4a4kv4")
    with replay(model, record, seq, pos, align=True) as st:
        loss = ... model(ids).logits ... + coef * st.alignment_loss()

Compared against: the unpatched transformers forward (bf16 mode, bit-identical) and fp4.fake_quant
(tests/qat/test_patch.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from trace import fp4, guidance
from trace.guidance import GuidanceRecord, Recorder, Runtime
from trace.models.registry import FAMILIES, family_of
from trace.qat.experts import experts_forward
from trace.settings import RLSettings

MODES = ("bf16", "w4a16", "w4a4", "w4a4kv4")
ATTN_IMPL = "trace_qat_sdpa"
EXPERTS_IMPL = "trace_qat_eager"


@dataclass
class QATRuntime(Runtime):
    """The guidance runtime of one patched model plus its mode (which sites are quantized)."""

    mode: str = "w4a4"
    # recompute each expert's gate/up GEMM and SiLU product in the backward instead of keeping them (the
    # trainer's largest saved activations on the small MoE flavors; values and gradients unchanged)
    recompute_experts: bool = RLSettings.recompute_experts
    # the experts' implementation (trace/qat/experts.py): "loop" (the reference), "grouped" (tokens sorted by
    # expert, grouped GEMMs) or "auto" (grouped on every device, measured faster on the CPU too)
    experts: str = RLSettings.experts

    @property
    def weights(self) -> bool:
        return self.mode != "bf16"

    @property
    def acts(self) -> bool:
        return self.mode in ("w4a4", "w4a4kv4")

    @property
    def kv(self) -> bool:
        return self.mode == "w4a4kv4"

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        # unchecked for finiteness (a device wait per weight per forward): the trainers check logits and loss
        return fp4.fake_quant_weight(w, self.fmt, check_values=False) if self.weights else w


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
            rt.record_routing(self._trace_layer, idx)
            replayed = rt.route(self._trace_layer, logits, idx, renorm=self._trace_renorm)
            if replayed is None:
                return logits, scores, idx
            w, ids = replayed
            return logits, w.to(scores.dtype), ids

    ReplayRouter.__name__ = orig_cls.__name__
    ReplayRouter.__qualname__ = orig_cls.__qualname__
    return ReplayRouter


_ROUTER_CLASSES: dict[type, type] = {}


def trace_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts with FP4 sites (trace/qat/experts.py: the loop or the grouped path, per `QATRuntime.experts`).
    hidden_states [N, H], top_k_index/weights [N, k]."""
    rt = _rt(self)
    if rt is None:
        return type(self).__mro__[0].forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    return experts_forward(self, rt, hidden_states, top_k_index, top_k_weights)


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
        new = torch.cat([fp4.fake_quant(rows[:, : t - t_new], rt.fmt, "row", check_values=False), new], dim=1)
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
    renorm = FAMILIES[family_of(model.config)].renormalizes(model.config)
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
            gate._trace_renorm = renorm  # the family's rule (FamilyInfo.renormalizes), not the router's attributes
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


def runtime(model) -> QATRuntime:
    """The guidance runtime of a model patched by `patch_model` (what `trace.guidance.Method.replay` takes)."""
    rt = _rt(model)
    if rt is None:
        raise ValueError("the model is not patched for QAT (trace.qat.patch_model)")
    return rt


def recording(model, recorder: Recorder, seq: torch.Tensor, pos: torch.Tensor):
    """`trace.guidance.recording` on a patched model's runtime: forwards in the block fill `recorder`.
    seq [B] sequence ids, pos [B, T] positions (-1 for padding)."""
    return guidance.recording(model._trace_rt, recorder, seq, pos)


def replay(model, record: GuidanceRecord, seq: torch.Tensor, pos: torch.Tensor, **kw):
    """`trace.guidance.replay` on a patched model's runtime (keywords: guide, guide_layers, routing,
    align, full_codes); yields the ReplayStats of the forwards in the block."""
    return guidance.replay(model._trace_rt, record, seq, pos, **kw)
