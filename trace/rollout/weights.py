"""Engine weights: load a policy's parameters by their Hugging Face names and (re)quantize them.

What: `EngineWeights.load(config, source, mode, fmt, dtype, device)` reads the transformers 5
in-memory names (fused experts `mlp.experts.gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`, router
`mlp.gate.weight [E, H]`, qwen2_moe `mlp.shared_expert.*` + `mlp.shared_expert_gate.weight`, q/k
norms, biases) from a model or a state_dict. In `w4a4` mode every linear weight of attention, experts,
shared expert and dense MLPs goes through `trace.fp4.quantize_weight` -- THE weight quantizer the
trainer uses, applied to the trainer's master tensor as given, so codes/scales/outer scales are
bit-identical to the trainer's -- and the engine keeps the FP4Tensor (`fp4[name]`) plus its dequantized
value in the engine dtype for the torch compute path. Router, embeddings, lm_head, norms, biases and
`shared_expert_gate` stay unquantized (DESIGN.md §2).

Per tensor: `weights.load_tensor(name, tensor, mode, fmt)` re-quantizes one parameter, by its HF name, into the
tensors an already loaded `EngineWeights` holds (the same function and casts as `load`, so the same bits), for a
sync that receives the parameters one at a time and keeps none of them (trace/integrations/openrlhf/rollout.py).

Compared against: `trace.fp4.quantize_weight` (tests/rollout/test_engine.py checks identical codes).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from trace import fp4
from trace.fp4 import quantize_weight
from trace.models.registry import FAMILIES, family_of, head_dim_of

# Linear weights that are FP4-quantized in w4a4 mode, by their name inside a layer.
QUANTIZED = ("q", "k", "v", "o", "gate_up", "down", "sg", "su", "sd", "mg", "mu", "md")
SHARED = ("sg", "su", "sd", "shared_gate")  # the shared expert's weights (FamilyInfo.shared_expert)
# The model-level tensors, by HF name -> EngineWeights field.
TOP_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
LAYER_NAMES = {
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight", "q_b": "self_attn.q_proj.bias", "k_b": "self_attn.k_proj.bias",
    "v_b": "self_attn.v_proj.bias", "o_b": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "ln1": "input_layernorm.weight", "ln2": "post_attention_layernorm.weight",
    "router": "mlp.gate.weight", "gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj",
    "sg": "mlp.shared_expert.gate_proj.weight", "su": "mlp.shared_expert.up_proj.weight",
    "sd": "mlp.shared_expert.down_proj.weight", "shared_gate": "mlp.shared_expert_gate.weight",
    "mg": "mlp.gate_proj.weight", "mu": "mlp.up_proj.weight", "md": "mlp.down_proj.weight",
}
LAYER_KEYS = {suffix: key for key, suffix in LAYER_NAMES.items()}
LAYER_PREFIX = "model.layers."


@dataclass
class Arch:
    """The numbers and the family quirks of the forward, read once from the HF config and the family's
    descriptor (trace/models/registry.py FamilyInfo): the forward branches on these, not on the family name."""

    family: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    rope_theta: float
    top_k: int
    num_experts: int
    renorm: bool  # renormalize the top-k probabilities (FamilyInfo.renormalizes)
    clip_qkv: float | None
    max_pos: int
    qk_norm: str = "none"  # FamilyInfo.qk_norm: "none", "per_head" or "full"
    routing_fp32: bool = False  # the top-k weights stay float32 (FamilyInfo.routing_dtype)
    shared_expert: bool = False  # FamilyInfo.shared_expert

    @classmethod
    def from_config(cls, config) -> "Arch":
        family = family_of(config)
        info = FAMILIES[family]
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rollout engine implements default RoPE only, got {rope.get('rope_type')!r}")
        n_exp = getattr(config, "num_experts", None) or config.num_local_experts
        return cls(family, int(config.num_hidden_layers), int(config.hidden_size), int(config.num_attention_heads),
                   int(config.num_key_value_heads), head_dim_of(config), int(config.vocab_size),
                   float(config.rms_norm_eps), float(theta), int(config.num_experts_per_tok), int(n_exp),
                   info.renormalizes(config), getattr(config, "clip_qkv", None), int(config.max_position_embeddings),
                   qk_norm=info.qk_norm, routing_fp32=info.routing_dtype == "float32",
                   shared_expert=info.shared_expert)

    def required(self, key: str) -> bool:
        """Whether every layer must hold the weight `key` (of `LAYER_NAMES`): attention and norms always,
        the q/k norms with `qk_norm` (the shared expert's are checked per MoE layer by `EngineWeights.load`)."""
        return key in ("q", "k", "v", "o", "ln1", "ln2") or (key in ("q_norm", "k_norm") and self.qk_norm != "none")


@dataclass
class EngineWeights:
    arch: Arch
    embed: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    layers: list[dict[str, torch.Tensor]]  # compute weights (dequantized FP4 in w4a4 mode)
    inv_freq: torch.Tensor  # [D/2] float32
    fp4: dict[str, fp4.FP4Tensor] = field(default_factory=dict)  # HF name -> FP4 weight (w4a4)

    @staticmethod
    def load(arch: Arch, source, mode: str, fmt: str, dtype: torch.dtype, device,
             inv_freq: torch.Tensor | None = None) -> "EngineWeights":
        """inv_freq: the RoPE frequencies (default: the model's own buffer, or for a state dict, which carries
        parameters only, computed from the config as transformers does)."""
        if isinstance(source, torch.nn.Module):
            sd = dict(source.state_dict())
            rot = getattr(getattr(source, "model", None), "rotary_emb", None)
            inv_freq = getattr(rot, "inv_freq", None) if inv_freq is None else inv_freq
        elif isinstance(source, dict):
            sd = source
        else:
            raise TypeError(f"sync_weights takes a transformers model or a state_dict, got {type(source).__name__}")

        def get(name: str, required: bool = True):
            t = sd.get(name)
            if t is None and required:
                raise KeyError(f"weight {name!r} missing from the given model/state_dict")
            return t

        def dense(t):
            return None if t is None else _owned(_cast(t, device, dtype), t)

        fp4w: dict[str, fp4.FP4Tensor] = {}
        layers = []
        for i in range(arch.num_layers):
            lw: dict[str, torch.Tensor] = {}
            for key, suffix in LAYER_NAMES.items():
                name = f"model.layers.{i}.{suffix}"
                t = get(name, required=arch.required(key))
                if t is None:
                    continue
                if mode == "w4a4" and key in QUANTIZED:
                    fp4w[name], lw[key] = _quantized(t, fmt, dtype, device)
                else:
                    lw[key] = dense(t)
            if "gate_up" not in lw and "mg" not in lw:
                raise KeyError(f"layer {i}: neither experts (mlp.experts.gate_up_proj) nor a dense MLP found")
            missing = [k for k in SHARED if "gate_up" in lw and arch.shared_expert and k not in lw]
            if missing:
                raise KeyError(f"layer {i}: the family's shared expert lacks {[LAYER_NAMES[k] for k in missing]}")
            layers.append(lw)
        # RoPE frequencies: the model's own buffer when given (a bf16 HF model keeps them bf16-rounded;
        # matching the trainer's forward wins), else computed in float32 like transformers.
        if inv_freq is None:
            d = arch.head_dim
            inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        inv_freq = _owned(_cast(inv_freq, device, torch.float32), inv_freq)
        return EngineWeights(arch, dense(get("model.embed_tokens.weight")), dense(get("model.norm.weight")),
                             dense(get("lm_head.weight")), layers, inv_freq, fp4w)

    def names(self) -> set[str]:
        """The HF names of every parameter these weights hold (what a sync must bring)."""
        held = set(TOP_NAMES)
        for i, lw in enumerate(self.layers):
            held |= {f"{LAYER_PREFIX}{i}.{LAYER_NAMES[k]}" for k in lw}
        return held

    def locate(self, name: str) -> tuple[int | None, str] | None:
        """(layer index, key of `LAYER_NAMES`) of a layer parameter, (None, field) of a model-level one, None for a
        name these weights do not hold (the engine computes nothing with it; `load` skips it too)."""
        if name in TOP_NAMES:
            return None, TOP_NAMES[name]
        if not name.startswith(LAYER_PREFIX):
            return None
        index, _, suffix = name[len(LAYER_PREFIX):].partition(".")
        key = LAYER_KEYS.get(suffix)
        if not index.isdigit() or key is None or int(index) >= len(self.layers) or key not in self.layers[int(index)]:
            return None
        return int(index), key

    def load_tensor(self, name: str, tensor: torch.Tensor, mode: str, fmt: str) -> str | None:
        """Load one parameter by its HF name into the tensors these weights hold, as `load` would from a state dict
        holding it: in w4a4 mode a quantized weight through `quantize_weight` (on the tensor where it lives), its
        FP4Tensor and dequantized copy written in place; any other weight cast to the engine's dtype in place.
        In place (`copy_into`) keeps captured decode graphs valid, as `RolloutEngine.sync_weights` does. Returns
        "copied"; "replaced" where the new value differs in kind (shape, dtype, the FP4Tensor's fields) from the one
        held, which then takes the held one's place (the engine rebuilds its forward after the sync); None where the
        name is not one these weights hold."""
        where = self.locate(name)
        if where is None:
            return None
        i, key = where
        held = getattr(self, key) if i is None else self.layers[i][key]
        with torch.no_grad():
            if i is not None and mode == "w4a4" and key in QUANTIZED:
                q, deq = _quantized(tensor, fmt, held.dtype, held.device)
                if copy_into((self.fp4[name], held), (q, deq)):
                    return "copied"
                self.fp4[name], self.layers[i][key] = q, deq
                return "replaced"
            new = _cast(tensor, held.device, held.dtype)
            if copy_into(held, new):
                return "copied"
            new = _owned(new, tensor)
            if i is None:
                setattr(self, key, new)
            else:
                self.layers[i][key] = new
            return "replaced"


def _cast(t: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(device=device, dtype=dtype).contiguous()


def _owned(out: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """`out`, or a copy where it is `source` itself: the engine owns its tensors (a later sync copies into them)."""
    return out.clone() if out.data_ptr() == source.data_ptr() else out


def _quantized(t: torch.Tensor, fmt: str, dtype: torch.dtype, device) -> tuple:
    """(FP4Tensor, its dequantized compute copy) of a weight: the trainer's function on the master tensor where it
    lives, the codes then moved where the engine's kernels read them."""
    q = quantize_weight(t.detach(), fmt).to(device)
    return q, q.dequantize(dtype).to(device).contiguous()


def copy_into(dst, src) -> bool:
    """Copy every tensor of `src` into the tensor at the same place in `dst`, in place, where the two have one
    structure (dataclasses, dicts, lists and tuples of tensors with equal shapes, dtypes and devices, equal
    non-tensor fields); returns False, and copies nothing, where they differ. The engine's weight sync uses it
    so that captured decode graphs, which read the weights by address, stay valid (vLLM's weight reload keeps
    its CUDA graphs the same way: new values into the parameters it captured). An object with a
    `match_layouts(other)` method (kernels.gemm.PreparedFP4Weight) is first asked, on the src side, to build the
    lazily made layouts that dst has built, so that both sides have them."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    if not _pair_up(dst, src, pairs):
        return False
    with torch.no_grad():
        for d, s in pairs:
            if d.data_ptr() != s.data_ptr():
                d.copy_(s)
    return True


def _pair_up(dst, src, pairs: list) -> bool:
    if isinstance(dst, torch.Tensor) or isinstance(src, torch.Tensor):
        ok = (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and dst.shape == src.shape
              and dst.dtype == src.dtype and dst.device == src.device and dst.stride() == src.stride())
        if ok:
            pairs.append((dst, src))
        return ok
    if type(dst) is not type(src):
        return False
    if isinstance(dst, dict):
        return dst.keys() == src.keys() and all(_pair_up(dst[k], src[k], pairs) for k in dst)
    if isinstance(dst, (list, tuple)):
        return len(dst) == len(src) and all(_pair_up(d, s, pairs) for d, s in zip(dst, src, strict=False))
    if dataclasses.is_dataclass(dst):
        if hasattr(src, "match_layouts"):
            src.match_layouts(dst)
        return all(_pair_up(getattr(dst, f.name), getattr(src, f.name), pairs) for f in dataclasses.fields(dst))
    return dst == src
