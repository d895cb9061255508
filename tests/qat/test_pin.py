"""trace/qat/pin.py: a decoder's layer inputs pinned to given values (the exact arm's backward at the engine's
activations). What is compared: the patched (w4a4kv4) model's logits on tokens A with every layer input pinned to the
residual streams of its own run on tokens B, against the logits of that run (torch.equal: the same ops on the same
values, float32 on the CPU); and the pinned forward's gradient, which must reach every layer's weights and the
embedding (through the straight-through identity between layers)."""
import pytest
import torch

from trace.models import build_model
from trace.qat import patch_model, pinned_inputs


def _streams(model, ids):
    """The residual stream entering each decoder layer and the final norm, from forward pre-hooks."""
    got, handles = [], []
    for m in [*model.model.layers, model.model.norm]:
        handles.append(m.register_forward_pre_hook(
            lambda _m, a, kw: got.append((a[0] if a else kw["hidden_states"]).detach().clone()), with_kwargs=True))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    for h in handles:
        h.remove()
    return got, logits


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_pinned_forward_takes_the_streams_values_and_passes_gradients(family):
    torch.manual_seed(0)
    model = build_model(f"{family}-tiny", 0, initializer_range=0.1)
    patch_model(model, "w4a4kv4")
    a, b = torch.randint(4, 100, (2, 7)), torch.randint(4, 100, (2, 7))
    streams, logits_b = _streams(model, b)
    assert len(streams) == model.config.num_hidden_layers + 1
    with pinned_inputs(model, streams):
        out = model(input_ids=a).logits
    assert torch.equal(out.detach(), logits_b)
    out.float().logsumexp(-1).sum().backward()
    for i, layer in enumerate(model.model.layers):
        g = layer.self_attn.q_proj.weight.grad
        assert g is not None and float(g.abs().sum()) > 0, i
    assert float(model.model.embed_tokens.weight.grad.abs().sum()) > 0
    with torch.no_grad():  # the hooks are gone on exit
        assert not torch.equal(model(input_ids=a).logits, logits_b)
    with pytest.raises(ValueError, match="streams"):
        with pinned_inputs(model, streams[:-1]):
            pass
