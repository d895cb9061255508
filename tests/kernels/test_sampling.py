"""The fused sampler (kernels/sampling.py) against the float64 oracle (kernels.reference.sample_reference):
greedy tokens exactly torch.argmax's (ties to the first index, across blocks too), log-probs within 1e-5, the
finite flag; sampled tokens the exponential race's over the kernel's own uniforms (up to fp32 near-ties), their
frequencies softmax's, the same per seed.
Runs on a GPU, or on the CPU under TRITON_INTERPRET=1 (the conftest sets it where there is no GPU)."""
import math

import pytest
import torch

from kernels import reference as ref
from kernels.sampling import fused_sample, sampler_uniforms

dev = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,block", [(1000, 256), (777, 1024)])
def test_greedy_is_torch_argmax_with_its_log_prob(dtype, V, block):
    """Seeded random logits, a row whose maximum repeats in two blocks and one whose maximum is the last element:
    the token is the first index of the row's maximum, the log-prob log_softmax's at temperature 1."""
    g = torch.Generator().manual_seed(V + block)  # other logits per case, the same every run
    x = (torch.randn(5, V, generator=g) * 4).to(dtype)
    x[1, 3] = x[1, V - 2] = 50.0  # a tie across blocks: the first wins
    x[2, V - 1] = 60.0
    tok, lp, finite = fused_sample(x.to(dev), 0.0, block=block)
    want_tok, want_lp, _ = ref.sample_reference(x, 0.0)
    assert torch.equal(tok.cpu(), want_tok) and tok.cpu()[1] == 3 and tok.cpu()[2] == V - 1
    assert torch.allclose(lp.cpu().double(), want_lp, atol=1e-5, rtol=0) and bool(finite)


def test_non_finite_logits_are_flagged():
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2, 123] = bad
        for t in (0.0, 1.0):
            assert not bool(fused_sample(y.to(dev), t, block=128)[2])
    assert bool(fused_sample(x.to(dev), 1.0, block=128)[2])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_samples_are_the_exponential_race_over_the_same_uniforms(temperature):
    """Seeded random logits over several blocks: the token is argmax p / q over q = -log(u) of the uniforms the kernel
    draws (`sampler_uniforms`), computed in float64 (torch.multinomial's one-sample draw), up to near-ties the
    kernel's fp32 keys cannot order (the two keys within 1e-5 relative); the log-prob is that token's."""
    g = torch.Generator().manual_seed(round(100 * temperature))  # other logits per case, the same every run
    x = torch.randn(6, 700, generator=g) * 2
    seed = int(torch.randint(1 << 40, (), generator=g))
    tok, lp, finite = fused_sample(x.to(dev), temperature, seed=seed, block=256)
    tok = tok.cpu()
    u = sampler_uniforms(6, 700, seed, dev).cpu()
    want = ref.sample_reference(x, temperature, u)[0]
    key = torch.log_softmax(x.double() / temperature, -1) - torch.log(-torch.log(u.double().clamp_min(1e-30)))
    r = torch.arange(6)
    near = (key[r, tok] - key[r, want]).abs() <= 1e-5 * key[r, want].abs().clamp_min(1.0)
    assert ((tok == want) | near).all()
    lsm = torch.log_softmax(x.double() / temperature, -1)[r, tok]
    assert torch.allclose(lp.cpu().double(), lsm, atol=1e-5, rtol=0) and bool(finite)
    assert torch.equal(fused_sample(x.to(dev), temperature, seed=seed, block=256)[0].cpu(), tok)
    assert not torch.equal(sampler_uniforms(6, 700, seed + 1, dev).cpu(), u)


def test_samples_follow_softmax():
    """512 rows of the same 6 logits: each token's frequency within 6 standard errors of softmax's probability (a
    check of the draw itself, independent of the oracle's formula)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    tok = fused_sample(logits.repeat(512, 1).to(dev), 1.0, seed=11, block=8)[0].cpu()
    p = torch.softmax(logits.double(), -1)
    freq = torch.bincount(tok, minlength=6).double() / len(tok)
    assert ((freq - p).abs() <= 6 * (p * (1 - p) / len(tok)).sqrt()).all(), (freq, p)


def test_a_dominant_logit_is_always_drawn_and_empty_input_is_fine():
    x = torch.full((64, 50), -30.0)
    x[:, 17] = 30.0  # probability 1 - 49 e^-60
    tok, lp, _ = fused_sample(x.to(dev), 1.0, seed=3, block=16)
    assert (tok.cpu() == 17).all() and torch.allclose(lp.cpu(), torch.zeros(64), atol=1e-6)
    tok, lp, finite = fused_sample(torch.zeros(0, 50, device=dev), 1.0)
    assert tok.shape == (0,) and lp.shape == (0,) and bool(finite)
    with pytest.raises(ValueError):
        fused_sample(x.to(dev), -1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine's size: GPU only")
def test_sampler_at_the_engine_size_on_a_gpu():
    """256 x 151,936 bf16 logits at the default block: greedy tokens exactly torch.argmax's; log-probs of greedy
    and sampled tokens within 1e-4 of float64 log_softmax (the normalizer sums 151,936 terms in fp32)."""
    g = torch.Generator(device="cuda").manual_seed(9)
    x = (torch.randn(256, 151936, device="cuda", generator=g) * 3).to(torch.bfloat16)
    tok, lp, finite = fused_sample(x, 0.0)
    want_tok, want_lp, _ = ref.sample_reference(x, 0.0)
    assert torch.equal(tok, want_tok) and torch.allclose(lp.double(), want_lp, atol=1e-4, rtol=0) and bool(finite)
    tok, lp, _ = fused_sample(x, 1.0, seed=5)
    want_lp = torch.log_softmax(x.double(), -1).gather(-1, tok[:, None]).squeeze(-1)
    assert torch.allclose(lp.double(), want_lp, atol=1e-4, rtol=0)
    # a draw's log-prob averages to minus the entropy's neighbourhood: no row picks a token far in the tail
    assert lp.min().item() > math.log(1e-9)
