"""Model registry: four MoE families x four flavors, built from transformers config classes.

Names are ``"<family>-<flavor>"`` with family in ``qwen3_moe | mixtral | olmoe | qwen2_moe`` and flavor in

* ``tiny``  -- CPU, trains in minutes (4 layers, hidden 64, 8 experts top-2, expert intermediate 64,
  vocab = the character tokenizer, 256 positions). Used by the ``smoke`` profile and the tests.
* ``small`` -- one GPU (8 layers, hidden 512); the committed small-scale reproduction.
* ``medium`` -- the paper flavor's layer shapes (hidden size, experts, expert width, top-k, heads, KV heads,
  head_dim, shared expert, norms, RoPE) with few layers (``MEDIUM_LAYERS``), random init: one decoder layer
  costs what it costs in the real model, so rollout and RL-step timings measure the method at scale (the
  small flavors' decode steps are launch-bound). Each trains with AdamW beside its rollout engine on one H200
  (parameter counts and memory in trace/models/FAMILIES.md section 7). It keeps the character tokenizer and
  2048 positions of tiny/small: the tasks are character-tokenized, and the real 32k-152k vocabularies would
  only add embedding and lm_head cost that says nothing about FP4 (the ``paper`` vocab is not used).
* ``paper`` -- the real checkpoint's hyper-parameters written out as config kwargs, plus its hub id.
  Only the *config* is ever built in tests; the weights come from the hub on a cluster (never here).

Choices that hold for every flavor (documented because the QAT patcher and the rollout engine rely on them):

* ``attn_implementation="sdpa"`` (PyTorch ``scaled_dot_product_attention``; ``"eager"`` is available
  as an override). Both the registry and :func:`trace.models.checkpoint.load_checkpoint` set it
  explicitly, because transformers does not serialize it into ``config.json``.
* ``experts_implementation="eager"``: the per-expert Python loop of ``<Family>Experts.forward``
  (deterministic ``index_add_`` on CPU; easiest to read and to patch). ``"grouped_mm"`` (transformers'
  own default when not set) or ``"batched_mm"`` can be passed as an override for speed. Like the
  attention implementation it is not serialized, so :func:`load_checkpoint` sets it again.
* ``output_router_logits=False``: no load-balancing aux loss is computed or added to ``loss``. The
  family's real ``router_aux_loss_coef`` is kept in the config so ``output_router_logits=True`` (an
  override, or a forward kwarg) turns the aux loss on with the published coefficient.
* Untied input/output embeddings (all four real checkpoints are untied).
* Every FP4-quantized reduction dimension (hidden size, head_dim, attention output width
  ``num_heads*head_dim``, expert intermediate, shared-expert intermediate, dense-MLP intermediate) is a
  multiple of 32, so NVFP4 (blocks of 16) and MXFP4 (blocks of 32) tile them exactly.
  :func:`build_config` checks it (``check_fp4=False`` to skip).
* Routing follows the real model: ``norm_topk_prob`` True for Qwen3-MoE, False for OLMoE and
  Qwen2-MoE; Mixtral always renormalizes its top-k (no flag).
* Attention layout mirrors the real model: Qwen3-MoE and Mixtral use GQA; OLMoE and Qwen1.5-MoE are
  MHA (``num_key_value_heads == num_attention_heads``). Qwen3-MoE decouples ``head_dim`` from
  ``hidden/heads`` (its q width is 2x hidden, like the real 30B-A3B), which the tiny and small flavors
  keep so that patchers cannot silently assume ``num_heads*head_dim == hidden_size``.

Each family is a descriptor (:class:`FamilyInfo`: its classes and quirks) plus its flavors' config kwargs; the
rollout engine, the QAT patcher and the checks here read the descriptor, never the family's name, and
:func:`register_family` adds a family from outside this module. See ``trace/models/FAMILIES.md`` for the module
tree, parameter shapes and patch points of each family, and what a new family takes (section 6).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from trace.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

FP4_MULTIPLE = 32  # lcm of the NVFP4 (16) and MXFP4 (32) block sizes

ATTN_IMPLEMENTATION = "sdpa"
EXPERTS_IMPLEMENTATION = "eager"

FLAVOR_NAMES = ("tiny", "small", "medium", "paper")


QK_NORMS = ("none", "per_head", "full")
RENORMS = ("config", "always")
ROUTING_DTYPES = ("model", "float32")


@dataclass(frozen=True)
class FamilyInfo:
    """One MoE family as transformers 5.x implements it: its classes and every quirk that family-specific
    code reads. The rollout engine's forward and weight loader (trace/rollout/), the QAT patcher's router
    replay (trace/qat/patch.py) and the FP4 dimension checks below branch on these fields, never on the
    family's name, so a family whose quirks are a combination of these needs only its descriptor and
    flavors (:func:`register_family`; trace/models/FAMILIES.md, "Adding a family").
    """

    family: str
    model_type: str  # config.model_type: how a config or a checkpoint is mapped back to its family
    config_cls: type[PretrainedConfig]
    model_cls: type[PreTrainedModel]
    hub_id: str  # the real checkpoint the paper flavor mirrors
    expert_intermediate_attr: str  # config attribute holding the per-expert intermediate size
    # q/k RMSNorm: "per_head" (over head_dim on each head, before RoPE: Qwen3-MoE), "full" (over the whole q / k
    # projection before the head split: OLMoE; needs num_heads * head_dim == hidden_size) or "none"
    qk_norm: str = "none"
    shared_expert: bool = False  # mlp.shared_expert on every token, times sigmoid(mlp.shared_expert_gate(x)) (Qwen2)
    renorm: str = "config"  # top-k probabilities renormalized: "always" (Mixtral) or per config.norm_topk_prob
    routing_dtype: str = "model"  # top-k weights: cast to the router logits' dtype, or kept "float32" (Mixtral)
    dense_layers: bool = False  # config.mlp_only_layers / decoder_sparse_step can make layers dense MLPs (Qwen)

    def __post_init__(self):
        for name, allowed in (("qk_norm", QK_NORMS), ("renorm", RENORMS), ("routing_dtype", ROUTING_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"family {self.family!r}: {name} must be one of {allowed}, got {getattr(self, name)!r}")

    def renormalizes(self, config: PretrainedConfig) -> bool:
        """Whether the router divides its top-k probabilities by their sum, for this config."""
        return self.renorm == "always" or bool(getattr(config, "norm_topk_prob", False))

    def routing_weight_dtype(self, logits_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the top-k weights that multiply the experts' outputs."""
        return torch.float32 if self.routing_dtype == "float32" else logits_dtype


FAMILIES: dict[str, FamilyInfo] = {
    "qwen3_moe": FamilyInfo(
        "qwen3_moe", "qwen3_moe", Qwen3MoeConfig, Qwen3MoeForCausalLM, "Qwen/Qwen3-30B-A3B",
        "moe_intermediate_size", qk_norm="per_head", dense_layers=True,
    ),
    "mixtral": FamilyInfo(
        "mixtral", "mixtral", MixtralConfig, MixtralForCausalLM, "mistralai/Mixtral-8x7B-v0.1",
        "intermediate_size", renorm="always", routing_dtype="float32",
    ),
    "olmoe": FamilyInfo(
        "olmoe", "olmoe", OlmoeConfig, OlmoeForCausalLM, "allenai/OLMoE-1B-7B-0924",
        "intermediate_size", qk_norm="full",
    ),
    "qwen2_moe": FamilyInfo(
        "qwen2_moe", "qwen2_moe", Qwen2MoeConfig, Qwen2MoeForCausalLM, "Qwen/Qwen1.5-MoE-A2.7B",
        "moe_intermediate_size", shared_expert=True, dense_layers=True,
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    flavor: str
    config_cls: type[PretrainedConfig]
    model_cls: type[PreTrainedModel]
    config_kwargs: dict[str, Any] = field(hash=False)
    hub_id: str | None  # real checkpoint id for the paper flavor; None for tiny/small/medium (random init)

    @property
    def reference_hub_id(self) -> str:
        """The real checkpoint whose architecture this flavor mimics (for every flavor)."""
        return FAMILIES[self.family].hub_id


def _rope(theta: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": float(theta)}


# Settings shared by every flavor (see module docstring).
_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "output_router_logits": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    "attn_implementation": ATTN_IMPLEMENTATION,
    "experts_implementation": EXPERTS_IMPLEMENTATION,
}

# Tiny/small flavors use the character tokenizer.
_CHAR_VOCAB: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}

_FLAVOR_KWARGS: dict[str, dict[str, dict[str, Any]]] = {
    # ------------------------------------------------------------------ Qwen3-MoE
    "qwen3_moe": {
        "tiny": {
            **_CHAR_VOCAB,
            "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 32, "intermediate_size": 128, "moe_intermediate_size": 64, "num_experts": 8,
            "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_parameters": _rope(1e6),
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "router_aux_loss_coef": 0.001,
        },
        "small": {
            **_CHAR_VOCAB,
            "num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 128, "intermediate_size": 1536, "moe_intermediate_size": 256, "num_experts": 32,
            "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_parameters": _rope(1e6),
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "router_aux_loss_coef": 0.001,
        },
        # Qwen/Qwen3-30B-A3B config.json
        "paper": {
            "vocab_size": 151936, "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
            "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "rope_parameters": _rope(1e6), "attention_bias": False, "use_sliding_window": False,
            "sliding_window": None, "router_aux_loss_coef": 0.001, "bos_token_id": 151643,
            "eos_token_id": 151645,
        },
    },
    # ------------------------------------------------------------------ Mixtral
    "mixtral": {
        "tiny": {
            **_CHAR_VOCAB,
            "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "intermediate_size": 64, "num_local_experts": 8, "num_experts_per_tok": 2,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_parameters": _rope(1e6),
            "sliding_window": None, "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0,
        },
        "small": {
            **_CHAR_VOCAB,
            "num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 64, "intermediate_size": 1792, "num_local_experts": 8, "num_experts_per_tok": 2,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_parameters": _rope(1e6),
            "sliding_window": None, "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0,
        },
        # mistralai/Mixtral-8x7B-v0.1 config.json
        "paper": {
            "vocab_size": 32000, "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "num_local_experts": 8,
            "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
            "rope_parameters": _rope(1e6), "sliding_window": None, "router_aux_loss_coef": 0.02,
            "router_jitter_noise": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        },
    },
    # ------------------------------------------------------------------ OLMoE
    # OLMoE's q_norm is an RMSNorm over hidden_size applied to the full q projection, so
    # num_attention_heads * head_dim must equal hidden_size (head_dim is implicit: hidden / heads).
    "olmoe": {
        "tiny": {
            **_CHAR_VOCAB,
            "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
            "intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_parameters": _rope(1e4),
            "attention_bias": False, "clip_qkv": None, "router_aux_loss_coef": 0.01,
        },
        "small": {
            **_CHAR_VOCAB,
            "num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8,
            "intermediate_size": 256, "num_experts": 32, "num_experts_per_tok": 8, "norm_topk_prob": False,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_parameters": _rope(1e4),
            "attention_bias": False, "clip_qkv": None, "router_aux_loss_coef": 0.01,
        },
        # allenai/OLMoE-1B-7B-0924 config.json
        "paper": {
            "vocab_size": 50304, "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 16,
            "num_key_value_heads": 16, "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
            "norm_topk_prob": False, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_parameters": _rope(1e4), "attention_bias": False, "clip_qkv": None,
            "router_aux_loss_coef": 0.01, "pad_token_id": 1, "bos_token_id": None, "eos_token_id": 50279,
        },
    },
    # ------------------------------------------------------------------ Qwen2-MoE (Qwen1.5-MoE)
    "qwen2_moe": {
        "tiny": {
            **_CHAR_VOCAB,
            "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
            "intermediate_size": 128, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
            "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
            "rope_parameters": _rope(1e6), "qkv_bias": True, "use_sliding_window": False,
            "router_aux_loss_coef": 0.001,
        },
        "small": {
            **_CHAR_VOCAB,
            "num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8,
            "intermediate_size": 1536, "moe_intermediate_size": 384, "shared_expert_intermediate_size": 1536,
            "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
            "rope_parameters": _rope(1e6), "qkv_bias": True, "use_sliding_window": False,
            "router_aux_loss_coef": 0.001,
        },
        # Qwen/Qwen1.5-MoE-A2.7B config.json
        "paper": {
            "vocab_size": 151936, "num_hidden_layers": 24, "hidden_size": 2048, "num_attention_heads": 16,
            "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
            "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_parameters": _rope(1e6),
            "qkv_bias": True, "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21,
            "router_aux_loss_coef": 0.001, "bos_token_id": 151643, "eos_token_id": 151643,
        },
    },
}


# Decoder layers of each family's medium flavor: as many as fit a trainer (FP32 master weights, gradients, AdamW
# moments: 16 bytes per parameter) beside its engine on one H200 with the activations of a long-answer RL step;
# about 2.5B parameters or fewer (FAMILIES.md section 7 has the counts and the memory estimate).
MEDIUM_LAYERS = {"qwen3_moe": 4, "mixtral": 2, "olmoe": 4, "qwen2_moe": 4}
MEDIUM_MAX_POSITIONS = 2048  # a character-tokenized prompt (< 64 tokens) + 1,024 generated tokens fit


def _medium(paper: dict[str, Any], layers: int) -> dict[str, Any]:
    """The medium flavor's kwargs: the paper flavor's, with the character vocabulary, `layers` decoder layers and
    MEDIUM_MAX_POSITIONS positions (a window over more layers than the model has is cut to its layers)."""
    kw = {**paper, **_CHAR_VOCAB, "num_hidden_layers": layers, "max_position_embeddings": MEDIUM_MAX_POSITIONS}
    if "max_window_layers" in kw:
        kw["max_window_layers"] = min(kw["max_window_layers"], layers)
    return kw


for _family, _layers in MEDIUM_LAYERS.items():
    _FLAVOR_KWARGS[_family]["medium"] = _medium(_FLAVOR_KWARGS[_family]["paper"], _layers)
del _family, _layers


def _family_flavors(info: FamilyInfo, flavors: dict[str, dict[str, Any]]) -> dict[str, ModelSpec]:
    unknown = sorted(set(flavors) - set(FLAVOR_NAMES))
    if unknown:
        raise ValueError(f"family {info.family!r}: unknown flavor(s) {unknown}; flavors are {FLAVOR_NAMES}")
    return {
        f"{info.family}-{flavor}": ModelSpec(
            name=f"{info.family}-{flavor}", family=info.family, flavor=flavor, config_cls=info.config_cls,
            model_cls=info.model_cls, config_kwargs={**_COMMON, **flavors[flavor]},
            hub_id=info.hub_id if flavor == "paper" else None,
        )
        for flavor in FLAVOR_NAMES if flavor in flavors
    }


def _make_flavors() -> dict[str, ModelSpec]:
    out: dict[str, ModelSpec] = {}
    for family, flavors in _FLAVOR_KWARGS.items():
        out.update(_family_flavors(FAMILIES[family], flavors))
    return out


FLAVORS: dict[str, ModelSpec] = _make_flavors()


def register_family(info: FamilyInfo, flavors: dict[str, dict[str, Any]]) -> list[str]:
    """Add a family and its flavors (flavor name -> config kwargs, on top of the common ones) to the registry;
    returns the new model names. Everything that lists families or models (tests' parametrizations, the
    pipeline's model check, `list_models`) reads the registry, so the family is then known everywhere."""
    if info.family in FAMILIES:
        raise ValueError(f"family {info.family!r} is already registered")
    if any(f.model_type == info.model_type for f in FAMILIES.values()):
        raise ValueError(f"model_type {info.model_type!r} already belongs to a registered family")
    specs = _family_flavors(info, flavors)
    FAMILIES[info.family] = info
    FLAVORS.update(specs)
    return list(specs)


def unregister_family(family: str) -> None:
    """Remove a family registered by :func:`register_family` and its flavors."""
    FAMILIES.pop(family)
    for name in [n for n, s in FLAVORS.items() if s.family == family]:
        del FLAVORS[name]


def list_models(family: str | None = None, flavor: str | None = None) -> list[str]:
    """Registered model names, optionally filtered by family and/or flavor."""
    return [
        n for n, s in FLAVORS.items()
        if (family is None or s.family == family) and (flavor is None or s.flavor == flavor)
    ]


def get_spec(name: str) -> ModelSpec:
    try:
        spec = FLAVORS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; registered: {', '.join(FLAVORS)}") from None
    # Defensive copy: callers may mutate config_kwargs (lists/dicts inside) without touching the registry.
    return ModelSpec(
        name=spec.name, family=spec.family, flavor=spec.flavor, config_cls=spec.config_cls,
        model_cls=spec.model_cls, config_kwargs=copy.deepcopy(spec.config_kwargs), hub_id=spec.hub_id,
    )


# Keys accepted in overrides that are not plain fields of every config class.
_EXTRA_KEYS = {"head_dim", "rope_theta", "attn_implementation", "experts_implementation", "dtype"}


def _allowed_keys(config_cls: type[PretrainedConfig]) -> set[str]:
    default = config_cls()
    return set(default.to_dict()) | set(getattr(config_cls, "attribute_map", {})) | _EXTRA_KEYS


def family_of(obj: PretrainedConfig | PreTrainedModel | str) -> str:
    """Family name for a config, a model, a registry name or a ``model_type``."""
    if isinstance(obj, str):
        if obj in FLAVORS:
            return FLAVORS[obj].family
        model_type = obj
    else:
        config = obj.config if isinstance(obj, PreTrainedModel) else obj
        model_type = config.model_type
    for fam in FAMILIES.values():
        if fam.model_type == model_type:
            return fam.family
    raise KeyError(f"model_type {model_type!r} is not one of the registered MoE families {list(FAMILIES)}")


def head_dim_of(config: PretrainedConfig) -> int:
    """head_dim exactly as the family's attention module computes it."""
    hd = getattr(config, "head_dim", None)
    return int(hd) if hd else config.hidden_size // config.num_attention_heads


def fp4_reduction_dims(config: PretrainedConfig) -> dict[str, int]:
    """Every reduction (input) dimension that FP4 quantization blocks, by site.

    ``hidden_size``: q/k/v, expert gate/up and shared-expert gate/up inputs; ``attn_out``: o_proj input
    (``num_heads * head_dim``); ``head_dim``: K and V cache rows; ``expert_intermediate``: expert down
    input; ``shared_expert_intermediate``: shared-expert down input (qwen2_moe); ``dense_intermediate``:
    down input of dense-MLP layers, only when the config actually has such layers (Qwen ``mlp_only_layers``
    or ``decoder_sparse_step > 1``).
    """
    info = FAMILIES[family_of(config)]
    hd = head_dim_of(config)
    dims = {
        "hidden_size": int(config.hidden_size),
        "head_dim": hd,
        "attn_out": int(config.num_attention_heads) * hd,
        "expert_intermediate": int(getattr(config, info.expert_intermediate_attr)),
    }
    if info.shared_expert:
        dims["shared_expert_intermediate"] = int(config.shared_expert_intermediate_size)
    if info.dense_layers:
        n_layers = config.num_hidden_layers
        sparse = [
            (i not in config.mlp_only_layers) and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
            for i in range(n_layers)
        ]
        if not all(sparse):
            dims["dense_intermediate"] = int(config.intermediate_size)
    return dims


def check_fp4_dims(config: PretrainedConfig, multiple: int = FP4_MULTIPLE) -> None:
    """Raise ``ValueError`` naming every FP4 reduction dimension that is not a multiple of ``multiple``."""
    bad = {k: v for k, v in fp4_reduction_dims(config).items() if v % multiple}
    if bad:
        raise ValueError(
            f"{config.model_type}: FP4 reduction dimensions must be multiples of {multiple} "
            f"(NVFP4 blocks of 16, MXFP4 blocks of 32); offending: {bad}"
        )


def build_config(name: str, check_fp4: bool = True, **overrides: Any) -> PretrainedConfig:
    """Config object for a registered model, with optional overrides (unknown keys raise ``KeyError``)."""
    spec = get_spec(name)
    allowed = _allowed_keys(spec.config_cls)
    unknown = sorted(k for k in overrides if k not in allowed)
    if unknown:
        raise KeyError(f"{name}: unknown config key(s) {unknown} for {spec.config_cls.__name__}")
    kwargs = {**spec.config_kwargs, **overrides}
    if "rope_theta" in overrides:
        kwargs["rope_parameters"] = _rope(kwargs.pop("rope_theta"))
    config = spec.config_cls(**kwargs)
    family = family_of(config)
    if FAMILIES[family].qk_norm == "full" and config.num_attention_heads * head_dim_of(config) != config.hidden_size:
        raise ValueError(f"{family}: num_attention_heads * head_dim must equal hidden_size (its q_norm spans the "
                         "whole q projection)")
    if check_fp4:
        check_fp4_dims(config)
    return config


def build_model(
    name: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    check_fp4: bool = True,
    **overrides: Any,
) -> PreTrainedModel:
    """Randomly initialised model; the weights depend only on ``(name, overrides, seed)``.

    Initialisation always runs in float32 on the CPU under a forked RNG seeded with ``seed`` (the global
    RNG state is left untouched), then the model is cast to ``dtype`` and moved to ``device``. So the
    same seed gives the same float32 weights everywhere, and a bf16 model is exactly their rounding.
    Meant for the tiny, small and medium flavors; the paper flavor's weights come from its hub checkpoint.
    """
    spec = get_spec(name)
    config = build_config(name, check_fp4=check_fp4, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.model_cls(config)
    model = model.to(dtype=dtype)
    if device is not None:
        model = model.to(device)
    model.eval()
    return model


__all__ = [
    "ATTN_IMPLEMENTATION", "EXPERTS_IMPLEMENTATION", "FAMILIES", "FLAVORS", "FLAVOR_NAMES", "FP4_MULTIPLE",
    "FamilyInfo", "MEDIUM_LAYERS", "ModelSpec", "build_config", "build_model", "check_fp4_dims", "family_of",
    "fp4_reduction_dims", "get_spec", "head_dim_of", "list_models", "register_family", "unregister_family",
]
