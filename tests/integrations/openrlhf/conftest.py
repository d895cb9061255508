"""OpenRLHF tests need the OpenRLHF stack (scripts/install.sh installs it); skipped without it."""
import pytest

pytest.importorskip("openrlhf", reason="the OpenRLHF stack is not installed (bash scripts/install.sh)")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (bash scripts/install.sh)")
pytest.importorskip("ray", reason="ray is not installed (bash scripts/install.sh)")
