"""Helpers shared by the task tests."""
import pytest

from trace.tasks.base import CHARSET


def assert_charset(text: str) -> None:
    bad = sorted({c for c in text if c not in CHARSET})
    assert not bad, f"characters outside printable ASCII + newline: {bad!r} in {text!r}"


@pytest.fixture
def charset_ok():
    return assert_charset


@pytest.fixture
def allow_weak_sandbox(monkeypatch):
    """Where no kernel layer confines the sandbox's filesystem, it refuses to run anything unless opted in;
    tests of its other layers and of the verifier's scoring opt in there (test_sandbox_hostile.py tests the
    refusal itself, and the hostile programs against the kernel layers)."""
    from trace.tasks import sandbox

    if not sandbox.capabilities()["boundary"]:
        monkeypatch.setenv(sandbox.ALLOW_ENV, "1")
