"""Checkpoint round trip through save_pretrained / Auto classes (local directory only)."""
import pytest
import torch

from trace.models.checkpoint import load_checkpoint, save_checkpoint
from trace.models.registry import build_model, list_models
from trace.models.tokenizer import VOCAB_SIZE, build_tokenizer


@pytest.mark.parametrize("name", list_models(flavor="tiny"))
def test_round_trip_identical(name, tmp_path):
    model = build_model(name, seed=11)
    tok = build_tokenizer()
    # perturb one weight so the test cannot pass by re-initialising from the same seed
    with torch.no_grad():
        model.model.layers[-1].mlp.experts.down_proj[3].add_(0.5)
    out = save_checkpoint(model, tok, tmp_path / "ckpt")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()

    model2, tok2 = load_checkpoint(out)
    assert type(model2) is type(model) and not model2.training
    assert model2.config._attn_implementation == model.config._attn_implementation
    assert model2.config._experts_implementation == model.config._experts_implementation
    s1, s2 = model.state_dict(), model2.state_dict()
    assert s1.keys() == s2.keys()
    for k in s1:
        assert s1[k].dtype == s2[k].dtype and torch.equal(s1[k], s2[k]), k

    text = ["def f(x):\n    return x + 1\n", "12 * 7 = 84\n"]
    ids = torch.tensor([tok2(t)["input_ids"][:12] for t in text])
    assert ids.tolist() == [tok(t)["input_ids"][:12] for t in text]
    with torch.no_grad():
        a, b = model(ids).logits, model2(ids).logits
    assert a.shape == (2, 12, VOCAB_SIZE)
    assert torch.equal(a, b)


def test_load_in_bf16(tmp_path):
    model = build_model("qwen2_moe-tiny", seed=1)
    save_checkpoint(model, None, tmp_path)
    model16, tok = load_checkpoint(tmp_path, dtype=torch.bfloat16, load_tokenizer=False)
    assert tok is None
    s1, s2 = model.state_dict(), model16.state_dict()
    for k in s1:
        assert s2[k].dtype == torch.bfloat16 and torch.equal(s2[k], s1[k].to(torch.bfloat16)), k


def test_missing_checkpoint_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nope")
