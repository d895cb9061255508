#!/usr/bin/env bash
# Install the pinned environment into .venv (if needed) and run the test suite on the CPU.
# Triton kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py when no GPU is present).
# Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
