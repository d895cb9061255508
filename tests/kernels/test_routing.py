"""The fused router (kernels/routing.py) against torch's softmax -> topk -> renormalise -> cast: on logits whose
probabilities are far apart (no ties, no near-ties) the same experts in the same order, the weights within float32's
exponential and summation error (1e-5 relative) and, cast to bf16, within one rounding; exact ties go to the lower
expert id. Runs on a GPU, or on the CPU under the interpreter."""
import pytest
import torch

from kernels.routing import topk_softmax
from tests.kernels.conftest import DEV


def _torch(logits, k, renorm, dtype):
    v, i = torch.topk(torch.softmax(logits.float(), -1), k, dim=-1)
    if renorm:
        v = v / v.sum(-1, keepdim=True)
    return v.to(dtype), i


def _spaced(N, E, g, dtype):
    """Per row a random permutation of a grid 1/16 apart, centred, plus an integer offset: exact in bf16 (|x| < 8
    needs 1/32), neighbouring probabilities ~6% apart."""
    grid = (torch.arange(E).float() - E // 2) / 16
    rows = torch.stack([grid[torch.randperm(E, generator=g)] for _ in range(N)])
    return (rows + torch.randint(-2, 3, (N, 1), generator=g)).to(dtype)


@pytest.mark.parametrize("E,k", [(128, 8), (8, 2), (60, 4), (64, 8)])
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("dtype,out", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                       (torch.float32, torch.float32)])
def test_the_same_experts_and_weights_as_torch(E, k, renorm, dtype, out):
    g = torch.Generator().manual_seed(1000 * E + 10 * k + renorm)  # other logits per case, the same every run
    logits = _spaced(37, E, g, dtype)
    v, i = topk_softmax(logits.to(DEV), k, renorm, out)
    wv, wi = _torch(logits, k, renorm, out)
    assert i.dtype == torch.int64 and v.dtype == out and v.shape == (37, k)
    assert torch.equal(i.cpu(), wi)
    tol = 1e-5 if out == torch.float32 else torch.finfo(out).eps  # bf16: one rounding apart at most
    assert ((v.cpu().float() - wv.float()).abs() <= tol * wv.float().abs()).all()


def test_ties_go_to_the_lower_expert_and_empty_is_fine():
    logits = torch.zeros(2, 16)
    logits[0, [3, 9, 12]] = 2.0
    logits[1, [15, 0]] = 1.0
    v, i = topk_softmax(logits.to(DEV), 3, True)
    assert i.cpu().tolist() == [[3, 9, 12], [0, 15, 1]]
    assert torch.allclose(v.cpu().sum(-1), torch.ones(2))
    v, i = topk_softmax(torch.zeros(0, 16).to(DEV), 2, False)
    assert v.shape == (0, 2) and i.shape == (0, 2)
    with pytest.raises(ValueError):
        topk_softmax(logits.to(DEV), 17, False)
