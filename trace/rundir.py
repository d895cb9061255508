"""Run directories: metadata, the per-step metrics log, checkpoints and resume.

Layout (the contract with the Snakemake pipeline and analysis/):

    DIR/config.yaml      resolved config (defaults filled in)
    DIR/meta.json        git commit, library versions, host, CPU/GPU (device, host's GPU count), python,
                         start time (+ resumes, and the earlier attempts' ends), end time (written with `done`)
    DIR/metrics.jsonl    one JSON object per step; the source of truth (wandb only mirrors it)
    DIR/ckpt/step_XXXXXX model (safetensors) + tokenizer + trainer_state.pt (optimizer, step)
    DIR/ckpt/latest      name of the newest complete checkpoint (written atomically, last)
    DIR/done             written when the run finished

Start-up: `check_inputs` validates what a config points at (registry model, init checkpoint of the
same architecture, JSONL files) and raises ConfigError naming the key; `prepare_run_dir` runs it
before creating anything, so a bad command leaves no run folder that would block the corrected one.
A restarted run says on stderr that it resumes, from which step and checkpoint.

Resume: `MetricsLog.open(dir, upto_step)` drops lines after the checkpoint's step (and a torn last
line from a kill -9), so the restarted run appends without duplicates or gaps. Everything a run
draws at random derives from (seed, step) through its own generators, so no global RNG state is
checkpointed. `read_metrics` is the one reader of metrics.jsonl (trainers, tests and analysis/).
Compared against: nothing upstream; tests/test_rundir.py (resume truncation, torn lines, pointers).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from trace import settings as S
from trace.config import ConfigError, diff_keys, dump_config

_ROOT = str(Path(__file__).resolve().parent.parent)


def git_commit() -> str | None:
    """HEAD (with -dirty when tracked files differ). TRACE_GIT_COMMIT overrides it where the copy's .git is not
    the repository's (a copy of the working tree sent to a GPU machine can hold the launching commit's files
    beside an older .git; git_tree below still checks that the files are that commit's)."""
    if os.environ.get("TRACE_GIT_COMMIT"):
        return os.environ["TRACE_GIT_COMMIT"]
    try:
        root = _ROOT
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return None
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001 - meta data is best effort, never fatal
        return None


def _git_tree() -> str | None:
    """The git tree id of the tracked files as they are on disk (the commit's tree when clean). A copy of the
    repository whose .git lags its files (a copy holding a newer commit's files beside the .git of an older
    one) still names its code: `git log --format='%H %T' | grep TREE` finds the commit."""
    import tempfile
    try:
        root = _ROOT
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
            for cmd in (["read-tree", "HEAD"], ["add", "-u"]):
                if subprocess.run(["git", "-C", root, *cmd], env=env, capture_output=True, timeout=60).returncode:
                    return None
            out = subprocess.run(["git", "-C", root, "write-tree"], env=env, capture_output=True, text=True,
                                 timeout=60)
            return out.stdout.strip() if out.returncode == 0 else None
    except Exception:  # noqa: BLE001 - meta data is best effort, never fatal
        return None


def git_diff() -> str:
    """`git diff HEAD` of the tracked files: '' when they are HEAD's, or outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", _ROOT, "diff", "HEAD", "--binary"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout if out.returncode == 0 else ""


def _git_diff_sha256() -> str | None:
    """sha256 of `git_diff()` where the tracked files differ from HEAD (the patch that workflow/scripts/launch.py
    keeps beside a run made from a dirty tree), else None; None on a copy named by TRACE_GIT_COMMIT."""
    if os.environ.get("TRACE_GIT_COMMIT"):
        return None
    diff = git_diff()
    if not diff:
        return None
    import hashlib
    return hashlib.sha256(diff.encode()).hexdigest()


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:  # noqa: BLE001
        return None


# the environment variables meta.json records where set: the switches' overrides (trace/settings.py ENV), and the
# rebuild notes and GPU-test flag of the GPU scripts
ENV_KEYS = (*S.ENV.values(), "TRACE_SFT_REBUILD", "TRACE_GPU_TESTS")


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat()


def _host_gpus() -> int | None:
    """GPUs of the machine, not only those CUDA_VISIBLE_DEVICES shows this process (nvidia-smi ignores it)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    n = sum(line.startswith("GPU ") for line in out.stdout.splitlines())
    return n if out.returncode == 0 and n else None


def _boot_id() -> str | None:
    """Tells apart machines of one hostname (freshly started cloud machines are often all called alike)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def collect_meta() -> dict:
    import torch
    gpu = None
    if torch.cuda.is_available():
        gpu = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "git_commit": git_commit(),
        "git_tree": _git_tree(),
        "git_diff_sha256": _git_diff_sha256(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "python": sys.version.split()[0],
        "hostname": socket.gethostname(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        # which of the machine's GPUs the job ran on (workflow/scripts/launch.py pins each job to one) and how
        # many the machine has: analysis/gputime.py adds up GPU time per device from them
        "gpu_device": os.environ.get("CUDA_VISIBLE_DEVICES") if gpu else None,
        "host_gpus": _host_gpus() if gpu else None,
        "boot_id": _boot_id(),
        "argv": sys.argv,
        # settings read from the environment that change what a run computes (the rollout's FP4 backend and
        # its kernels-vs-BF16 crossover, trace/rollout/fast.py; the FP4 library's RTN path, trace/fp4), how
        # the SFT base it starts from was trained again on another machine, and the GPU test suite's outcome
        # before the run started (both set by scripts/gpu/profile_chunk.sh)
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
        "start_time": utc_now(),
    }


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_inputs(cfg: dict, ckpts: dict | None = None) -> None:
    """Raise ConfigError unless `cfg["model"]` is a registry model, every checkpoint in `ckpts`
    ({key named in the error: path or None}) resolves to a checkpoint of that model's architecture,
    and the task's JSONL files load. Reads configs and data only, writes nothing."""
    from trace.models.checkpoint import check_checkpoint_model
    from trace.models.registry import get_spec
    from trace.tasks.datasets import DatasetError, load_jsonl
    try:
        get_spec(cfg["model"])
    except KeyError as e:
        raise ConfigError(f"config key 'model': {e.args[0]}") from None
    for key, path in (ckpts or {}).items():
        if not path:
            continue
        try:
            check_checkpoint_model(cfg["model"], resolve_checkpoint(path))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}: {e}") from None
    t = cfg["task"]
    for split in ("train", "validation", "test"):
        path = t.get(f"{split}_jsonl")
        if path:
            try:
                load_jsonl(path, t["prompt_key"], t["label_key"],
                           default_datasource=t["name"])
            except DatasetError as e:
                raise ConfigError(f"config key 'task.{split}_jsonl': {e}") from None


def prepare_run_dir(out: str | os.PathLike, cfg: dict, kind: str) -> Path:
    """Check the inputs (`check_inputs`; an RL run's `rl.init_ckpt` too), then create DIR, write
    config.yaml (or check it matches on a restart) and meta.json; say so on stderr when resuming."""
    check_inputs(cfg, {"rl.init_ckpt": cfg["rl"].get("init_ckpt")} if kind.startswith("rl") else None)
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    cfg_path = d / "config.yaml"
    text = dump_config(cfg)
    if cfg_path.exists():
        old = S.migrate(yaml.safe_load(cfg_path.read_text()))  # a config written before a key had its default
        if old != yaml.safe_load(text):
            diff = sorted(diff_keys(old, cfg))
            raise ConfigError(f"{d} holds a run with a different config (keys {diff}); use a new --out")
    else:
        _atomic_write(cfg_path, text)
    meta_path = d / "meta.json"
    meta = collect_meta()
    meta["kind"] = kind
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        # the attempt before this one keeps its own end (None where it was killed): a finished run started
        # again must not count the time in between as run time (analysis/gputime.py)
        old.setdefault("attempt_ends", []).append(old.pop("end_time", None))
        old.setdefault("resumes", []).append(meta["start_time"])
        meta = old
    _atomic_write(meta_path, json.dumps(meta, indent=2))
    latest = latest_checkpoint(d)
    if latest is not None:
        note = "; finished, nothing to do" if (d / "done").exists() else ""
        print(f"[trace] resuming {d} from step {checkpoint_step(latest)} (checkpoint {latest}){note}",
              file=sys.stderr)
    return d


class MetricsLog:
    """Append-only JSONL of per-step metrics with resume truncation; mirrors to wandb if enabled."""

    def __init__(self, path: Path, wandb_run=None):
        self.path = path
        self.wandb = wandb_run
        self._f = open(path, "a")

    @classmethod
    def open(cls, run_dir: str | os.PathLike, upto_step: int | None, wandb_cfg: dict | None = None,
             cfg: dict | None = None, name: str = "metrics.jsonl") -> MetricsLog:
        """Keep lines with step <= upto_step (None: keep nothing) and drop a torn last line."""
        path = Path(run_dir) / name
        keep: list[str] = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line torn by kill -9; everything after it is not trustworthy
                if upto_step is not None and int(rec.get("step", -1)) <= upto_step:
                    keep.append(line)
            _atomic_write(path, "".join(k + "\n" for k in keep))
        return cls(path, _wandb_init(run_dir, wandb_cfg, cfg))

    def log(self, rec: dict) -> None:
        self._f.write(json.dumps(_jsonable(rec), sort_keys=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        if self.wandb is not None:
            flat = {k: v for k, v in _flatten(rec).items() if isinstance(v, (int, float))}
            self.wandb.log(flat, step=int(rec.get("step", 0)))

    def close(self) -> None:
        self._f.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def read_metrics(path: str | os.PathLike, last_per_step: bool = False) -> list[dict]:
    """The records of a metrics.jsonl in file order. A torn last line (a run killed mid-write) is
    ignored; an invalid line before it raises. last_per_step=True keeps one record per step (the
    last), in order of first appearance, for readers that must not count a step twice."""
    lines = Path(path).read_text().splitlines()
    recs: list[tuple[int, dict]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            recs.append((i, json.loads(line)))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: invalid JSON") from None
    if not last_per_step:
        return [r for _, r in recs]
    by_step: dict = {}
    for i, rec in recs:
        by_step[rec.get("step", i)] = rec  # a repeated key keeps its first position, takes the last value
    return list(by_step.values())


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None  # JSON has no NaN; a null is explicit
    return x


def _wandb_init(run_dir, wandb_cfg, cfg):
    """wandb mirrors the JSONL; offline by default in configs, disabled in tests. Never fatal."""
    if not wandb_cfg or wandb_cfg["mode"] == "disabled":
        return None
    try:
        import wandb
        return wandb.init(project=wandb_cfg.get("project"), name=wandb_cfg.get("name") or Path(run_dir).name,
                          mode=wandb_cfg["mode"], dir=str(run_dir), config=cfg, resume="allow",
                          id=Path(run_dir).resolve().name.replace("/", "_")[:64])
    except Exception as e:  # noqa: BLE001
        print(f"[trace] wandb disabled: {e}", file=sys.stderr)
        return None


# ----------------------------------------------------------------------------------------------
# Checkpoint directory bookkeeping (model files via trace.models.save_checkpoint)
# ----------------------------------------------------------------------------------------------
def ckpt_root(run_dir) -> Path:
    return Path(run_dir) / "ckpt"


def latest_checkpoint(run_dir) -> Path | None:
    root = ckpt_root(run_dir)
    ptr = root / "latest"
    if not ptr.exists():
        return None
    p = root / ptr.read_text().strip()
    return p if (p / "config.json").exists() else None


def checkpoint_step(step_dir) -> int:
    """The step of a ckpt/step_XXXXXX directory (from its name; no weights are read)."""
    return int(Path(step_dir).name.split("_")[-1])


def commit_checkpoint(run_dir, step_dir: Path, keep: int = 1) -> None:
    """Point `latest` at step_dir (atomic), then delete older step dirs beyond `keep`."""
    root = ckpt_root(run_dir)
    _atomic_write(root / "latest", step_dir.name)
    olds = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name != step_dir.name)
    for p in olds[: max(0, len(olds) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)


def resolve_checkpoint(path) -> Path:
    """A model directory from: a model dir (has config.json), a run dir or its ckpt/ dir (latest)."""
    p = Path(path)
    if (p / "config.json").exists():
        return p
    for cand in (p, p.parent):
        latest = latest_checkpoint(cand)
        if latest is not None:
            return latest
    raise FileNotFoundError(f"no checkpoint at {str(p)!r} (need config.json, or a run dir with ckpt/latest)")


def save_run_checkpoint(run_dir, step: int, model, tokenizer, state: dict, keep: int = 1) -> Path:
    """Model (safetensors) + tokenizer + `trainer_state.pt` (optimizer, step, ...) into
    ckpt/step_XXXXXX, then the atomic `latest` pointer. A kill -9 before the pointer moves leaves the
    previous checkpoint as the resume point."""
    import torch

    from trace.models import save_checkpoint
    d = ckpt_root(run_dir) / f"step_{step:06d}"
    if d.exists():
        shutil.rmtree(d)
    save_checkpoint(model, tokenizer, d)
    torch.save({**state, "step": step}, d / "trainer_state.pt")
    commit_checkpoint(run_dir, d, keep=keep)
    return d


def load_trainer_state(ckpt_dir) -> dict:
    import torch
    return torch.load(Path(ckpt_dir) / "trainer_state.pt", weights_only=False)


def note_meta(run_dir, key: str, value) -> None:
    """Record how a run computes (a choice not in its config) in meta.json; a resumed run must make the same
    choice, or its halves would differ in what they computed."""
    meta_path = Path(run_dir) / "meta.json"
    meta = json.loads(meta_path.read_text())
    if key in meta and meta[key] != value:
        raise ConfigError(f"{run_dir} was started with {key}={meta[key]!r}, now {value!r}; resume it as it started")
    meta[key] = value
    _atomic_write(meta_path, json.dumps(meta, indent=2))


def progress_bar(iterable, desc: str, enabled: bool = True):
    """A tqdm bar on stderr, shown only when `enabled` and stderr is a terminal (never in log files);
    TQDM_DISABLE=1 turns it off everywhere."""
    from tqdm import tqdm

    on = enabled and not os.environ.get("TQDM_DISABLE") and sys.stderr is not None and sys.stderr.isatty()
    return tqdm(iterable, desc=desc, disable=not on, file=sys.stderr)


class Interrupted(Exception):
    """Ctrl-C (SIGINT) during a training run: the step it stopped in and the step a rerun of the same
    command resumes from (the one after the latest checkpoint; metrics logged past it are dropped and
    redone on resume)."""

    def __init__(self, run_dir, step: int | None):
        last = latest_checkpoint(run_dir)
        self.step = step
        self.resume_step = (checkpoint_step(last) if last is not None else 0) + 1
        where = f"at step {step}" if step is not None else "before the first step"
        super().__init__(f"interrupted {where}; rerun the same command to resume from step {self.resume_step}")


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C


class SigintGuard:
    """Ctrl-C during a training loop, kept even where Python swallows the KeyboardInterrupt. The handler
    raises KeyboardInterrupt as Python's default does and also sets `requested`; a KeyboardInterrupt raised
    while a finalizer (`__del__`, a weakref callback) runs is printed and ignored by Python, so the loop
    calls `check()` at every step boundary, which raises it again. Installed only in the main thread."""

    def __init__(self):
        self.requested = False
        self._prev = None

    def _handler(self, signum, frame):
        self.requested = True
        raise KeyboardInterrupt

    def __enter__(self):
        import signal
        import threading
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        import signal
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)
            self._prev = None
        return False

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt


def report_interrupt(message) -> int:
    """One line on stderr, no traceback; the exit status of an interrupted command."""
    print(str(message), file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def mark_done(run_dir, info: dict | None = None) -> None:
    """Write `done`, after meta.json's end_time: the marker is what the pipeline waits for, so a run that has
    it always has its end time (analysis/gputime.py)."""
    meta_path = Path(run_dir) / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        meta["end_time"] = utc_now()
        _atomic_write(meta_path, json.dumps(meta, indent=2))
    _atomic_write(Path(run_dir) / "done", json.dumps(info or {}) + "\n")


def set_threads(cfg: dict) -> None:
    import torch
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))


__all__ = [
    "MetricsLog", "check_inputs", "checkpoint_step", "ckpt_root", "collect_meta", "commit_checkpoint", "latest_checkpoint", "load_trainer_state",
    "mark_done", "note_meta", "prepare_run_dir", "read_metrics", "resolve_checkpoint", "save_run_checkpoint", "set_threads", "utc_now",
]
