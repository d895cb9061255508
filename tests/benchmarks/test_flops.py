"""benchmarks/flops.py: N_active counted from a config equals the parameters of the built model's matrix
multiplies (experts at their top-k share), for every family; the PaLM attention term; the GEMM peak is GPU-only."""
import pytest

from benchmarks.flops import active_params, attention_flops_per_token, bf16_gemm_tflops, train_flops
from trace.models import build_model

FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"]


def _counted(model) -> int:
    """The built model's matmul parameters a token passes through: every weight of 2 or more dimensions but the
    embedding, the routed experts' at num_experts_per_tok / num_experts; the LM head once even when tied."""
    cfg = model.config
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    share = cfg.num_experts_per_tok / experts
    total, head = 0.0, False
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name:
            continue
        head = head or name.startswith("lm_head")
        routed = ".experts." in name or name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj")
        total += p.numel() * (share if routed else 1.0)
    if not head:
        total += cfg.vocab_size * cfg.hidden_size
    return round(total)


@pytest.mark.parametrize("family", FAMILIES)
def test_active_params_match_the_built_model(family):
    model = build_model(f"{family}-tiny", seed=0)
    assert active_params(model.config) == _counted(model)


def test_train_flops_adds_palm_attention_term():
    model = build_model("qwen3_moe-tiny", seed=0)
    c = model.config
    n = active_params(c)
    assert attention_flops_per_token(c, 10) == 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * 10
    assert train_flops(c, [10, 20]) == 10 * (6 * n + attention_flops_per_token(c, 10)) + 20 * (
        6 * n + attention_flops_per_token(c, 20))


def test_gemm_peak_is_none_off_a_gpu():
    assert bf16_gemm_tflops(device="cpu") is None
