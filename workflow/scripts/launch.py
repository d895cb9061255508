"""Run one training or evaluation entry point for the pipeline, and check what it left behind.

    python -m workflow.scripts.launch --stage rl --cmd "python -m trace.rl" --config CFG.yaml --out RUN_DIR
    python -m workflow.scripts.launch --stage eval --cmd "python -m trace.eval" --config CFG.yaml \
        --ckpt RUN_DIR/ckpt --out RUN_DIR/eval.json

The command gets the entry-point contract's arguments (``--config CFG --out DIR`` for sft/rl,
``--config CFG --ckpt DIR --out FILE.json`` for eval) plus any ``--set key=value`` given here.
For sft/rl the run dir carries a stamp of the config it was started with: an interrupted run with the
same config is resumed by the trainer (from its last checkpoint), a run dir left by a different config
(or with no checkpoint to resume from) is wiped first so stale metrics never mix with new ones.
Afterwards the `done` marker (sft/rl) or a well-formed eval JSON (eval) must exist, else exit 1.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys

STAMP = ".pipeline_config.sha256"


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def prepare_run_dir(out: str, config: str) -> None:
    digest = sha256(config)
    stamp = os.path.join(out, STAMP)
    if os.path.isdir(out) and os.listdir(out):
        old = open(stamp).read().strip() if os.path.exists(stamp) else None
        has_ckpt = os.path.isdir(os.path.join(out, "ckpt")) and bool(os.listdir(os.path.join(out, "ckpt")))
        if old != digest or not has_ckpt:
            why = "config changed" if old not in (None, digest) else (
                "no config stamp" if old is None else "no checkpoint to resume from")
            print(f"[launch] wiping {out} ({why})", flush=True)
            shutil.rmtree(out)
        else:
            print(f"[launch] resuming {out} (same config, checkpoint present)", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(stamp, "w") as f:
        f.write(digest + "\n")


def check_eval(path: str) -> None:
    with open(path) as f:
        d = json.load(f)
    for dep in ("bf16", "fp4"):
        if dep not in d or not isinstance(d[dep], dict):
            raise SystemExit(f"[launch] {path}: missing the {dep!r} deployment block")
        acc = d[dep].get("accuracy")
        if not isinstance(acc, (int, float)) or not math.isfinite(acc):
            raise SystemExit(f"[launch] {path}: {dep}.accuracy is not a finite number ({acc!r})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", choices=["sft", "rl", "eval"], required=True)
    ap.add_argument("--cmd", required=True, help="entry point, e.g. 'python -m trace.rl'")
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args(argv)

    cmd = shlex.split(a.cmd) + ["--config", a.config]
    if a.stage == "eval":
        if not a.ckpt:
            ap.error("--ckpt is required for --stage eval")
        if not os.path.exists(a.ckpt):
            raise SystemExit(f"[launch] checkpoint {a.ckpt} does not exist; rerun its training job "
                             f"(snakemake --forcerun rl ...)")
        cmd += ["--ckpt", a.ckpt]
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    else:
        prepare_run_dir(a.out, a.config)
    cmd += ["--out", a.out]
    for kv in a.set:
        cmd += ["--set", kv]
    print("[launch] " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        print(f"[launch] {a.stage} failed with exit status {rc}", file=sys.stderr)
        return rc
    if a.stage == "eval":
        check_eval(a.out)
    elif not os.path.exists(os.path.join(a.out, "done")):
        print(f"[launch] {a.stage} exited 0 but left no {a.out}/done marker", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
