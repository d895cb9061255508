"""The medium flavor: every family's paper layer shapes with few layers and the character vocabulary, built on the
meta device (no memory, no init), its parameter count in the range trace/models/FAMILIES.md section 7 documents."""
import pytest
import torch

from trace.models.registry import (
    FAMILIES,
    MEDIUM_LAYERS,
    build_config,
    fp4_reduction_dims,
    get_spec,
    head_dim_of,
    list_models,
)
from trace.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

FAMILY_NAMES = list(MEDIUM_LAYERS)
# Parameters of each medium model (FAMILIES.md section 7), to the nearest 0.01B.
DOCUMENTED_B = {"qwen3_moe": 2.49, "mixtral": 2.90, "olmoe": 1.68, "qwen2_moe": 2.28}
# The layer's shape as the real model has it: config attributes whose values the medium flavor must share.
SHAPE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_experts_per_tok", "rms_norm_eps",
              "rope_parameters", "hidden_act")


def _meta_model(name: str, **overrides):
    with torch.device("meta"):
        return get_spec(name).model_cls(build_config(name, **overrides))


def _per_layer(model) -> int:
    """Parameters of the decoder layers only (the embeddings follow the vocabulary)."""
    return sum(p.numel() for p in model.model.layers.parameters())


def test_every_family_has_a_medium_flavor():
    assert list_models(flavor="medium") == [f"{f}-medium" for f in FAMILIES]
    assert set(MEDIUM_LAYERS) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_real_layer_shapes_few_layers_char_vocab(family):
    info = FAMILIES[family]
    med, paper = build_config(f"{family}-medium"), build_config(f"{family}-paper")
    for key in SHAPE_KEYS:
        assert getattr(med, key) == getattr(paper, key), key
    assert head_dim_of(med) == head_dim_of(paper) == 128
    experts = "num_local_experts" if family == "mixtral" else "num_experts"
    assert getattr(med, experts) == getattr(paper, experts)
    assert getattr(med, info.expert_intermediate_attr) == getattr(paper, info.expert_intermediate_attr)
    assert info.renormalizes(med) == info.renormalizes(paper)
    if info.shared_expert:
        assert med.shared_expert_intermediate_size == paper.shared_expert_intermediate_size
    # every FP4 reduction dimension (the quantized GEMMs' K) is the real model's
    assert fp4_reduction_dims(med) == fp4_reduction_dims(paper)
    assert med.num_hidden_layers == MEDIUM_LAYERS[family] < paper.num_hidden_layers
    assert (med.vocab_size, med.pad_token_id, med.bos_token_id, med.eos_token_id) == (VOCAB_SIZE, PAD_ID, BOS_ID,
                                                                                     EOS_ID)
    assert med.max_position_embeddings >= 64 + 1024  # a task prompt and 1,024 generated tokens
    assert get_spec(f"{family}-medium").hub_id is None
    assert get_spec(f"{family}-medium").reference_hub_id == info.hub_id


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_meta_build_parameter_shapes_and_count(family):
    """The module tree on the meta device: one decoder layer's parameters are the real model's layer, tensor for
    tensor, and the whole model has the documented count."""
    med = _meta_model(f"{family}-medium")
    paper = _meta_model(f"{family}-paper", num_hidden_layers=1)
    layer_shapes = {n: p.shape for n, p in med.model.layers[0].named_parameters()}
    assert layer_shapes == {n: p.shape for n, p in paper.model.layers[0].named_parameters()}
    experts = med.model.layers[0].mlp.experts
    cfg = med.config
    width = getattr(cfg, FAMILIES[family].expert_intermediate_attr)
    n_exp = experts.gate_up_proj.shape[0]
    assert experts.gate_up_proj.shape == (n_exp, 2 * width, cfg.hidden_size)
    assert experts.down_proj.shape == (n_exp, cfg.hidden_size, width)
    assert hasattr(med.model.layers[0].mlp, "shared_expert") == FAMILIES[family].shared_expert
    assert len(med.model.layers) == MEDIUM_LAYERS[family]
    n = sum(p.numel() for p in med.parameters())
    assert _per_layer(med) == MEDIUM_LAYERS[family] * _per_layer(paper)
    assert n / 1e9 == pytest.approx(DOCUMENTED_B[family], abs=0.006)
    # FP32 master weights, gradients and AdamW's two moments (16 bytes per parameter) leave room on an H200's
    # 141 GB for the engine and the activations
    assert 16 * n < 50e9


def test_the_medium_profile_plans_the_learning_run_and_the_benchmark_arms():
    """experiments/profiles/medium.yaml validates against the pipeline schema and plans the issue's learning run
    (SFT base, then bf16, qat-independent and trace for >= 50 steps, one seed, qwen3_moe-medium) with valid run
    configs; trace-deep (for benchmarks/bench_rlstep.py) resolves to trace on the deepest half and runs nothing."""
    import sys
    from pathlib import Path

    import jsonschema
    import yaml

    from trace import config as C
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "workflow" / "scripts"))
    from runplan import Plan

    profile = yaml.safe_load((root / "experiments/profiles/medium.yaml").read_text())
    jsonschema.validate(profile, yaml.safe_load((root / "workflow/schemas/config.schema.yaml").read_text()))
    plan = Plan(profile)
    assert sorted((r.model, r.task, r.arm, r.seed) for r in plan.runs) == [
        ("qwen3_moe-medium", "reasoning", arm, 0) for arm in ("bf16", "qat-independent", "trace")]
    assert plan.sft_enabled
    for arm in ("bf16", "qat-independent", "trace", "trace-deep"):
        cfg = C.validate(C.deep_merge(C.DEFAULTS, plan.run_config("qwen3_moe-medium", "reasoning", arm, 0)))
        assert cfg["rl"]["steps"] >= 50 and cfg["rl"]["max_new_tokens"] >= 157  # reasoning's longest gold answer
        assert cfg["rl"]["rho"] == (0.5 if arm == "trace-deep" else 1.0)
        assert cfg["rl"]["method"] == ("trace" if arm == "trace-deep" else arm)
