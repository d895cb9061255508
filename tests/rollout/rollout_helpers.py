"""Helpers for the rollout-engine tests: tiny models of the registered families with sharper logits
(initializer_range 0.1 instead of 0.02, so log-prob comparisons are not trivially flat)."""
import torch

from trace.models import FAMILIES as REGISTERED
from trace.models import build_model

FAMILIES = tuple(REGISTERED)  # every registered family
INIT = 0.1


def tiny(family: str, dtype=torch.float32, seed: int = 0):
    return build_model(f"{family}-tiny", seed, dtype=dtype, initializer_range=INIT)


def hf_logprobs(model, seq: list[int]) -> torch.Tensor:
    """Log-probs of seq[1:] under a transformers model's full-sequence forward: [len-1] float32."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits.float()
    return torch.log_softmax(logits, -1)[0, :-1].gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)


def random_seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 100, (n,), generator=g).tolist() for n in lengths]
