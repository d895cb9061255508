"""Fixtures for tests/rollout (helpers live in rollout_helpers.py)."""
import pytest

from trace.models import build_tokenizer


@pytest.fixture(scope="session")
def tok():
    return build_tokenizer()


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny models' matmuls are far faster single-threaded (thread wake-up dominates on 2 cores)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
