#!/usr/bin/env bash
# Create .venv and install the pinned dependencies (requirements-dev.txt includes requirements.txt).
# torch==2.13.0 resolves to the CPU wheel on the dev/CI machines; elsewhere it is the PyPI build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# bubblewrap: the coding sandbox's kernel boundary (trace/tasks/sandbox.py; as root it refuses to run
# generated code without it). Best effort: skipped when bwrap is there, a note when apt cannot install it.
if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  { $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap \
    || { $sudo apt-get update -q && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap; }; } \
    >/dev/null 2>&1 || echo "note: could not install bubblewrap (apt-get install bubblewrap)" >&2
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.installed-$(cat requirements.txt requirements-dev.txt requirements-openrlhf.txt | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  # OpenRLHF stack (trace/integrations/openrlhf; why --no-deps / --no-build-isolation: requirements-openrlhf.txt)
  # (openrlhf last: a later pip run would list its unmet pins as resolver errors)
  .venv/bin/python -m pip install -q -r requirements-openrlhf.txt
  .venv/bin/python -m pip install -q --no-build-isolation deepspeed==0.19.8
  .venv/bin/python -m pip install -q --no-deps openrlhf==0.11.2
  touch "$stamp"
fi
