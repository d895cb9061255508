"""A fifth MoE family that exists only in the tests: its quirks are a combination no real family has, so
the family-specific code can only get it right by reading the descriptor (trace/models/registry.py
FamilyInfo), never by matching names.

`synth_moe` = Qwen2-MoE's block (routed experts + a sigmoid-gated shared expert, q/k/v biases) with
Qwen3-MoE's per-head q/k RMSNorm (and an o_proj bias), and Mixtral's router (always renormalizes its
top-k, keeps the weights float32) although its config says `norm_topk_prob=False`. The model is built from
the transformers modules of those families; registering it touches no file of the package.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

from trace.models.registry import FamilyInfo, register_family, unregister_family

FAMILY = "synth_moe"


class SynthConfig(Qwen2MoeConfig):
    model_type = FAMILY


class SynthRouter(Qwen2MoeTopKRouter):
    """Mixtral's routing on Qwen2-MoE's router parameters: renormalized top-k, float32 weights."""

    forward = MixtralTopKRouter.forward


class SynthForCausalLM(Qwen2MoeForCausalLM):
    config_class = SynthConfig

    def __init__(self, config):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = Qwen3MoeAttention(config, i)  # per-head q/k norm; biases on q, k, v and o
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.__class__ = SynthRouter
        self.init_weights()  # the new attention modules (the others are initialized already)
        for layer in self.model.layers:  # nonzero biases, so that the engine's bias terms are tested
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                torch.nn.init.normal_(getattr(layer.self_attn, proj).bias, std=config.initializer_range)


INFO = FamilyInfo(FAMILY, FAMILY, SynthConfig, SynthForCausalLM, "none/synthetic", "moe_intermediate_size",
                  qk_norm="per_head", shared_expert=True, renorm="always", routing_dtype="float32",
                  dense_layers=True)
FLAVORS = {"tiny": {
    "vocab_size": 100, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 8,
    "num_experts_per_tok": 3, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [1],
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default",
                                                                              "rope_theta": 1e4},
    "qkv_bias": True, "attention_bias": True, "use_sliding_window": False, "sliding_window": None,
    "router_aux_loss_coef": 0.001,
}}


@contextmanager
def registered():
    """The synthetic family in the registry for the duration of the block."""
    register_family(INFO, FLAVORS)
    try:
        yield f"{FAMILY}-tiny"
    finally:
        unregister_family(FAMILY)
