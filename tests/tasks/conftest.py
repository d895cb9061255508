"""Helpers shared by the task tests."""
import pytest

from trace.tasks.base import CHARSET


def assert_charset(text: str) -> None:
    bad = sorted({c for c in text if c not in CHARSET})
    assert not bad, f"characters outside printable ASCII + newline: {bad!r} in {text!r}"


@pytest.fixture
def charset_ok():
    return assert_charset
