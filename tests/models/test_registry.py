"""Model registry: names, paper configs, FP4 dimension constraint, tiny models forward/backward, seeding."""
import pytest
import torch

from trace.models.registry import (
    FAMILIES,
    FLAVORS,
    FP4_MULTIPLE,
    build_config,
    build_model,
    check_fp4_dims,
    family_of,
    fp4_reduction_dims,
    get_spec,
    head_dim_of,
    list_models,
    register_family,
)
from trace.models.tokenizer import VOCAB_SIZE

FAMILY_NAMES = list(FAMILIES)
TINY = [f"{f}-tiny" for f in FAMILY_NAMES]
ALL = [f"{f}-{v}" for f in FAMILY_NAMES for v in ("tiny", "small", "medium", "paper")]


def test_names_and_specs():
    assert sorted(list_models()) == sorted(ALL) and sorted(FLAVORS) == sorted(ALL)
    assert list_models(flavor="tiny") == TINY
    assert list_models(family="olmoe") == ["olmoe-tiny", "olmoe-small", "olmoe-medium", "olmoe-paper"]
    for name in ALL:
        spec = get_spec(name)
        fam, flavor = name.split("-")
        assert (spec.name, spec.family, spec.flavor) == (name, fam, flavor)
        assert spec.config_cls is FAMILIES[fam].config_cls and spec.model_cls is FAMILIES[fam].model_cls
        assert spec.hub_id == (FAMILIES[fam].hub_id if flavor == "paper" else None)
        assert family_of(name) == fam == family_of(build_config(name))
    with pytest.raises(KeyError, match="unknown model"):
        get_spec("llama-tiny")


def test_hub_ids():
    assert get_spec("qwen3_moe-paper").hub_id == "Qwen/Qwen3-30B-A3B"
    assert get_spec("mixtral-paper").hub_id == "mistralai/Mixtral-8x7B-v0.1"
    assert get_spec("olmoe-paper").hub_id == "allenai/OLMoE-1B-7B-0924"
    assert get_spec("qwen2_moe-paper").hub_id == "Qwen/Qwen1.5-MoE-A2.7B"


def test_get_spec_returns_a_copy():
    spec = get_spec("qwen3_moe-tiny")
    spec.config_kwargs["mlp_only_layers"].append(0)
    spec.config_kwargs["hidden_size"] = 7
    assert get_spec("qwen3_moe-tiny").config_kwargs["mlp_only_layers"] == []
    assert build_config("qwen3_moe-tiny").hidden_size == 64


# Published hyper-parameters of the real checkpoints (config.json on the hub).
PAPER_EXPECTED = {
    "qwen3_moe-paper": dict(
        vocab_size=151936, num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "mixtral-paper": dict(
        vocab_size=32000, num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
        rms_norm_eps=1e-5, router_aux_loss_coef=0.02, tie_word_embeddings=False,
    ),
    "olmoe-paper": dict(
        vocab_size=50304, num_hidden_layers=16, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=1024, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        max_position_embeddings=4096, rms_norm_eps=1e-5, router_aux_loss_coef=0.01, eos_token_id=50279,
        pad_token_id=1, clip_qkv=None,
    ),
    "qwen2_moe-paper": dict(
        vocab_size=151936, num_hidden_layers=24, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
        norm_topk_prob=False, qkv_bias=True, rms_norm_eps=1e-6,
    ),
}
PAPER_ROPE = {"qwen3_moe-paper": 1e6, "mixtral-paper": 1e6, "olmoe-paper": 1e4, "qwen2_moe-paper": 1e6}


@pytest.mark.parametrize("name", sorted(PAPER_EXPECTED))
def test_paper_configs(name):
    cfg = build_config(name)
    for key, value in PAPER_EXPECTED[name].items():
        assert getattr(cfg, key) == value, key
    assert cfg.rope_parameters["rope_theta"] == PAPER_ROPE[name]
    assert head_dim_of(cfg) == 128
    assert cfg.output_router_logits is False


@pytest.mark.parametrize("name", ALL)
def test_fp4_reduction_dims_are_multiples_of_32(name):
    cfg = build_config(name)
    dims = fp4_reduction_dims(cfg)
    assert {"hidden_size", "head_dim", "attn_out", "expert_intermediate"} <= set(dims)
    assert ("shared_expert_intermediate" in dims) == FAMILIES[get_spec(name).family].shared_expert
    assert all(v > 0 and v % FP4_MULTIPLE == 0 for v in dims.values()), dims
    check_fp4_dims(cfg)


def test_fp4_check_rejects_bad_dims():
    with pytest.raises(ValueError, match="expert_intermediate"):
        build_config("qwen3_moe-tiny", moe_intermediate_size=48)
    with pytest.raises(ValueError, match="shared_expert_intermediate"):
        build_config("qwen2_moe-tiny", shared_expert_intermediate_size=40)
    with pytest.raises(ValueError, match="head_dim"):
        build_config("mixtral-tiny", head_dim=24)
    # dense-MLP layers only count when the config has them
    assert "dense_intermediate" not in fp4_reduction_dims(build_config("qwen3_moe-tiny", intermediate_size=100))
    with pytest.raises(ValueError, match="dense_intermediate"):
        build_config("qwen3_moe-tiny", intermediate_size=100, mlp_only_layers=[0])
    cfg = build_config("qwen3_moe-tiny", moe_intermediate_size=48, check_fp4=False)
    assert cfg.moe_intermediate_size == 48


def test_unknown_override_key_is_named():
    with pytest.raises(KeyError, match="hiden_size"):
        build_config("mixtral-tiny", hiden_size=64)


def test_overrides_apply():
    cfg = build_config("olmoe-tiny", num_hidden_layers=2, rope_theta=500.0, output_router_logits=True)
    assert cfg.num_hidden_layers == 2 and cfg.rope_parameters["rope_theta"] == 500.0 and cfg.output_router_logits


@pytest.mark.parametrize("name", TINY)
def test_tiny_config_shape(name):
    cfg = build_config(name)
    assert cfg.vocab_size == VOCAB_SIZE and cfg.hidden_size == 64 and cfg.num_hidden_layers == 4
    assert cfg.max_position_embeddings == 256 and cfg.num_experts_per_tok == 2
    assert getattr(cfg, "num_experts", None) or cfg.num_local_experts
    assert cfg._attn_implementation == "sdpa" and cfg._experts_implementation == "eager"


def _batch(B=4, T=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB_SIZE, (B, T), generator=g)


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward_reaches_every_parameter(name):
    model = build_model(name, seed=0)
    model.train()
    x = _batch()
    out = model(input_ids=x, labels=x)
    assert out.logits.shape == (4, 64, VOCAB_SIZE)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    assert out.aux_loss is None  # load-balancing loss off by default
    out.loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname
    # 256 tokens x top-2 over 8 near-uniformly routed experts: every expert receives tokens, so every
    # expert slice of the fused 3-D weights gets a non-zero gradient in every layer.
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for w in (experts.gate_up_proj, experts.down_proj):
            per_expert = w.grad.abs().flatten(1).sum(1)
            assert (per_expert > 0).all(), per_expert


@pytest.mark.parametrize("name", TINY)
def test_deterministic_init(name):
    state = torch.random.get_rng_state()
    a = build_model(name, seed=0).state_dict()
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    b = build_model(name, seed=0).state_dict()
    c = build_model(name, seed=1).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    differing = [k for k in a if not torch.equal(a[k], c[k])]
    assert any("experts" in k for k in differing) and any("q_proj" in k for k in differing)


def test_dtype_is_cast_of_fp32_init():
    m32 = build_model("qwen2_moe-tiny", seed=5)
    m16 = build_model("qwen2_moe-tiny", seed=5, dtype=torch.bfloat16)
    s32, s16 = m32.state_dict(), m16.state_dict()
    for k in s32:
        assert s16[k].dtype == torch.bfloat16
        assert torch.equal(s16[k], s32[k].to(torch.bfloat16)), k
    x = _batch(2, 16)
    assert torch.isfinite(m16(x).logits).all()


def test_aux_loss_is_configurable():
    x = _batch(2, 32)
    m = build_model("olmoe-tiny", seed=0, output_router_logits=True)
    out = m(input_ids=x, labels=x)
    assert out.aux_loss is not None and torch.isfinite(out.aux_loss)
    base = build_model("olmoe-tiny", seed=0)(input_ids=x, labels=x).loss
    torch.testing.assert_close(out.loss, base + m.config.router_aux_loss_coef * out.aux_loss)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_experts_implementation_override_matches_eager(impl):
    x = _batch(2, 32)
    ref = build_model("qwen3_moe-tiny", seed=2)
    alt = build_model("qwen3_moe-tiny", seed=2, experts_implementation=impl)
    assert alt.config._experts_implementation == impl
    with torch.no_grad():
        torch.testing.assert_close(alt(x).logits, ref(x).logits, rtol=1e-4, atol=1e-5)


def test_eager_attention_matches_sdpa():
    x = _batch(2, 32)
    ref = build_model("mixtral-tiny", seed=2)
    alt = build_model("mixtral-tiny", seed=2, attn_implementation="eager")
    assert alt.config._attn_implementation == "eager"
    with torch.no_grad():
        torch.testing.assert_close(alt(x).logits, ref(x).logits, rtol=1e-4, atol=1e-5)


def test_a_registered_family_is_known_everywhere_and_only_while_registered():
    """A family registered in-process (tests/rollout/synthetic_family.py, defined in that one file) is listed,
    built and accepted by the run config and the pipeline's plan; unregistered, every one of them names the
    registered models instead. tests/rollout/test_engine.py runs the engine-vs-trainer checks on it."""
    import dataclasses
    import sys
    from pathlib import Path

    from tests.rollout.synthetic_family import FAMILY, FLAVORS, INFO, registered
    from trace import config as C

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflow" / "scripts"))
    from runplan import Plan

    plan = {"profile": "x", "models": [f"{FAMILY}-tiny"], "tasks": {"reasoning": {}}, "methods": ["trace"],
            "seeds": [0]}
    with registered() as name:
        assert list_models(family=FAMILY) == [name] and FAMILIES[FAMILY] is INFO
        cfg = build_config(name)
        assert family_of(cfg) == family_of(name) == FAMILY
        assert {"shared_expert_intermediate", "dense_intermediate"} <= set(fp4_reduction_dims(cfg))
        assert C.load_config(None, [f"model={name}"])["model"] == name
        assert [r.model for r in Plan(plan).runs] == [name]
        with pytest.raises(ValueError, match="already registered"):
            register_family(INFO, FLAVORS)
    assert FAMILY not in FAMILIES and not list_models(family=FAMILY)
    with pytest.raises(C.ConfigError, match="config key 'model': unknown model 'synth_moe-tiny'.*qwen3_moe-tiny"):
        C.load_config(None, [f"model={FAMILY}-tiny"])
    with pytest.raises(ValueError, match=r"unknown model\(s\) \['synth_moe-tiny'\]"):
        Plan(plan)
    with pytest.raises(ValueError, match="qk_norm must be one of"):
        dataclasses.replace(INFO, qk_norm="per_token")
    with pytest.raises(ValueError, match="unknown flavor"):
        register_family(INFO, {"huge": {}})
    assert FAMILY not in FAMILIES
