"""The SFT base gate (DESIGN.md §4 "SFT base gate"): an RL run of a gated task starts only from a base that answers.

A base passes when its evaluation on the VALIDATION split (`trace.eval` with `eval.split: validation`, the profile's
eval settings: temperature 1) has, in BF16 and in FP4 deployment alike, an accuracy inside ACC_BAND and a mean
response of at least MIN_RESPONSE_TOKENS generated tokens. Below the band the policy gradient at step 1 is near zero
(few groups hold a right answer) and every arm sits at the floor; above it there is little left for RL to learn; a
short response is not the long-generation task the gate guards.

    python -m trace.gate EVAL.json [EVAL.json ...]   # exit 1 with one line per failing base; 0 when all pass

Used by the calibration unit (scripts/gpu/calibrate_unit.sh), the SFT recipe search (scripts/gpu/sft_search_unit.sh)
and the pipeline (workflow/scripts/launch.py --gate, before an RL run's directory exists).
Pure Python: the pipeline reads it without torch.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from trace.settings import ADDED

ACC_BAND = (0.15, 0.85)  # validation accuracy, BF16 and FP4 deployment, both ends included
MIN_RESPONSE_TOKENS = 40  # mean generated tokens per sample, BF16 and FP4 deployment
MODES = ("bf16", "fp4")


class GateError(ValueError):
    """A base that the gate refuses; the message is one line naming the evaluation and every failed bound."""


def failures(ev: dict) -> list[str]:
    """What an evaluation (trace.eval's JSON as a dict) fails of the gate: [] when it passes."""
    split = (ev.get("eval") or {}).get("split", ADDED["eval.split"])  # evaluations written before the key: test
    if split != "validation":
        return [f"evaluated on the {split} split, not validation"]
    lo, hi = ACC_BAND
    out = []
    for m in MODES:
        r = ev.get(m)
        if not isinstance(r, dict):
            out.append(f"no {m.upper()} evaluation")
            continue
        acc, n_tok = float(r["accuracy"]), float(r["response_len"])
        if not lo <= acc <= hi:
            out.append(f"{m.upper()} accuracy {acc:.3f} outside {lo}-{hi}")
        if n_tok < MIN_RESPONSE_TOKENS:
            out.append(f"{m.upper()} mean response {n_tok:.1f} tokens < {MIN_RESPONSE_TOKENS}")
    return out


def check(path: str | Path) -> dict:
    """The evaluation at `path` if its base passes the gate; else GateError (one line)."""
    path = Path(path)
    if not path.is_file():
        raise GateError(f"SFT base gate: no validation evaluation {path}")
    ev = json.loads(path.read_text())
    bad = failures(ev)
    if bad:
        raise GateError(f"SFT base gate (DESIGN.md §4): {path}: " + "; ".join(bad) + "; no RL run starts from it")
    return ev


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else list(argv)
    if not paths:
        print("usage: python -m trace.gate EVAL.json [EVAL.json ...]", file=sys.stderr)
        return 2
    rc = 0
    for p in paths:
        try:
            check(p)
        except GateError as e:
            print(f"error: {e}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
