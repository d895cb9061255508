"""Run one training or evaluation entry point for the pipeline, and check what it left behind.

    python -m workflow.scripts.launch --stage rl --cmd "python -m trace.rl" --config CFG.yaml --out RUN_DIR
    python -m workflow.scripts.launch --stage eval --cmd "python -m trace.eval" --config CFG.yaml \
        --ckpt RUN_DIR/ckpt --out RUN_DIR/eval.json

The command gets the entry-point contract's arguments (``--config CFG --out DIR`` for sft/rl,
``--config CFG --ckpt DIR --out FILE.json`` for eval) plus any ``--set key=value`` given here; for stage rl,
what follows ``--`` here (a profile's ``openrlhf_flags``: train_ppo_ray flags) follows ``--`` there, last.
For sft/rl the run dir carries a stamp of the config it was started with: an interrupted run with the
same config is resumed by the trainer (from its last checkpoint), a run dir left by a different config
(or with no checkpoint to resume from) is wiped first so stale metrics never mix with new ones; the flags after
``--`` count as part of the config (the OpenRLHF launch refuses to resume a run with other flags).
Only committed code makes committed runs: with tracked files changed since HEAD the launch stops with one line, unless
TRACE_ALLOW_DIRTY=1, in which case the diff is saved beside the run (``dirty.patch`` in a run dir, ``<eval>.patch``
beside an evaluation) and meta.json records its hash (trace/rundir.py). A copy of the repository whose launching
commit is given in TRACE_GIT_COMMIT (a GPU machine's, whose .git may be older than its files) is not checked here:
its meta.json records the files' git tree, which names the commit.
With ``--gate VALIDATION.json`` (stage rl) the run starts only if its SFT base's validation evaluation passes the
SFT base gate (trace/gate.py): otherwise one error line and exit 1, before the run dir is touched.
Afterwards the `done` marker (sft/rl) or a well-formed eval JSON (eval) must exist, else exit 1.

GPU slots (``--gpu-slots K``, from the profile's ``gpu_slots_per_device`` for rules whose resources ask
for a gpu): the job takes one of K slots on one of the visible GPUs (``CUDA_VISIBLE_DEVICES`` if set, else
every GPU ``nvidia-smi -L`` lists) and runs with ``CUDA_VISIBLE_DEVICES`` set to that GPU alone, so
no rule names a device id. A slot is an exclusive ``flock`` on a lock file (in ``$TRACE_GPU_LOCK_DIR``,
default ``/tmp/trace-gpu-slots-<uid>``) held for the life of the job and dropped by the kernel when the
process ends, crashed or not. Slots are taken slot-major (slot 0 of every GPU before slot 1 of any), so
jobs spread over all GPUs first. Snakemake's ``--resources gpu=N`` caps concurrent jobs: N = GPUs x K.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time

from trace.rundir import git_diff as tracked_diff  # the tracked files' diff against HEAD ('' when clean)

STAMP = ".pipeline_config.sha256"


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def config_digest(config: str, passthrough: list[str] | None = None) -> str:
    """The run dir's stamp: the config file's sha256, with the flags after `--` (if any) hashed in."""
    digest = sha256(config)
    if passthrough:
        digest = hashlib.sha256((digest + "\0" + json.dumps(passthrough)).encode()).hexdigest()
    return digest


def prepare_run_dir(out: str, config: str, passthrough: list[str] | None = None) -> None:
    digest = config_digest(config, passthrough)
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


def visible_gpus() -> list[str]:
    """GPU ids this job may use: CUDA_VISIBLE_DEVICES when set, else the GPUs nvidia-smi lists."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def lock_dir() -> str:
    return os.environ.get("TRACE_GPU_LOCK_DIR") or f"/tmp/trace-gpu-slots-{os.getuid()}"


def acquire_gpu_slot(gpus: list[str], per_device: int, directory: str, poll_s: float = 2.0,
                     timeout_s: float | None = None) -> tuple[str, int]:
    """(GPU id, open fd holding its slot lock); waits while every slot is taken."""
    if not gpus:
        raise SystemExit("[launch] this job asks for a GPU slot but no GPU is visible")
    os.makedirs(directory, exist_ok=True)
    t0 = time.monotonic()
    while True:
        for slot in range(per_device):
            for g in gpus:
                fd = os.open(os.path.join(directory, f"gpu{g}-slot{slot}.lock"), os.O_CREAT | os.O_RDWR, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                return g, fd
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"no free GPU slot in {directory} after {timeout_s} s")
        time.sleep(poll_s)


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
    ap.add_argument("--gate", metavar="VALIDATION.json",
                    help="rl: the SFT base's validation evaluation, which must pass the SFT base gate (trace/gate.py) "
                         "before the run's directory is made")
    ap.add_argument("--gpu-slots", type=int, default=0, metavar="K",
                    help="take one of K slots per visible GPU and run on that GPU alone (0: no GPU pinning)")
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if passthrough and a.stage != "rl":
        ap.error("flags after `--` (train_ppo_ray's) apply to --stage rl only")

    diff = "" if os.environ.get("TRACE_GIT_COMMIT") else tracked_diff()
    if diff and os.environ.get("TRACE_ALLOW_DIRTY") != "1":
        print(f"[launch] error: tracked files differ from HEAD ({diff.count(chr(10) + 'diff --git') + 1} file(s)): commit "
              f"them first, or set TRACE_ALLOW_DIRTY=1 to keep the diff beside the run", file=sys.stderr)
        return 1
    if a.gate:
        from trace.gate import GateError, check
        try:
            check(a.gate)
        except GateError as e:  # one line, nothing written
            print(f"[launch] error: {e}", file=sys.stderr)
            return 1
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
        prepare_run_dir(a.out, a.config, passthrough)
    if diff:
        patch = os.path.join(a.out, "dirty.patch") if a.stage != "eval" else os.path.splitext(a.out)[0] + ".patch"
        with open(patch, "w") as f:
            f.write(diff)
    cmd += ["--out", a.out]
    for kv in a.set:
        cmd += ["--set", kv]
    if passthrough:
        cmd += ["--", *passthrough]
    env = None
    if a.gpu_slots > 0:
        gpu, _held = acquire_gpu_slot(visible_gpus(), a.gpu_slots, lock_dir())  # held until this process exits
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)
        print(f"[launch] GPU {gpu} (one of {a.gpu_slots} slots per GPU)", flush=True)
    print("[launch] " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    rc = subprocess.call(cmd, env=env)
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
