"""Run directories: config/meta, metrics truncation on resume, the one metrics reader (torn last
line, duplicate steps), checkpoint pointers and resolution."""
from __future__ import annotations

import json

import pytest
import yaml

from trace import config as C
from trace import rundir
from trace.rundir import read_metrics


def test_run_dir_and_metrics_truncation(tmp_path):
    cfg = C.load_config(None, [])
    d = rundir.prepare_run_dir(tmp_path / "run", cfg, kind="rl")
    meta = json.loads((d / "meta.json").read_text())
    for k in ("git_commit", "git_tree", "torch", "transformers", "triton", "hostname", "cpu", "gpu", "python", "start_time"):
        assert k in meta
    assert yaml.safe_load((d / "config.yaml").read_text()) == cfg
    # a restart with the same config is accepted and recorded; a different config is refused
    rundir.prepare_run_dir(d, cfg, kind="rl")
    assert len(json.loads((d / "meta.json").read_text())["resumes"]) == 1
    with pytest.raises(C.ConfigError, match="different config"):
        rundir.prepare_run_dir(d, C.load_config(None, ["rl.lr=0.5"]), kind="rl")

    log = rundir.MetricsLog.open(d, upto_step=None)
    for s in range(1, 6):
        log.log({"step": s, "x": float(s), "d": {1: 0.5}})
    log.close()
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "x":')  # torn by a kill -9
    log = rundir.MetricsLog.open(d, upto_step=3)
    log.log({"step": 4, "x": 40.0})
    log.close()
    recs = read_metrics(d / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and recs[-1]["x"] == 40.0
    assert recs[0]["d"] == {"1": 0.5}


def test_resolve_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        rundir.resolve_checkpoint(tmp_path)
    step = tmp_path / "ckpt" / "step_000003"
    step.mkdir(parents=True)
    (step / "config.json").write_text("{}")
    rundir.commit_checkpoint(tmp_path, step)
    assert rundir.resolve_checkpoint(tmp_path) == step
    assert rundir.resolve_checkpoint(tmp_path / "ckpt") == step
    assert rundir.resolve_checkpoint(step) == step


def test_read_metrics_torn_line_and_duplicate_steps(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(json.dumps({"step": 0, "k3": 1.0}) + "\n" + json.dumps({"step": 0, "k3": 2.0}) + "\n"
                 + json.dumps({"step": 1, "k3": 3.0}) + "\n" + '{"step": 2, "k3"')
    assert [r["k3"] for r in read_metrics(p, last_per_step=True)] == [2.0, 3.0]
    assert [r["k3"] for r in read_metrics(p)] == [1.0, 2.0, 3.0]  # the trainers' view: every line
    p.write_text('{"step": 0}\n{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match=":2: invalid JSON"):
        read_metrics(p)


def test_resumed_run_says_so_on_stderr(tmp_path, capsys):
    cfg = C.load_config(None, [])
    d = rundir.prepare_run_dir(tmp_path / "run", cfg, kind="rl")
    assert "resuming" not in capsys.readouterr().err  # a fresh run is not a resume
    step = rundir.ckpt_root(d) / "step_000007"
    step.mkdir(parents=True)
    (step / "config.json").write_text("{}")
    rundir.commit_checkpoint(d, step)
    rundir.prepare_run_dir(d, cfg, kind="rl")
    err = capsys.readouterr().err
    assert f"resuming {d} from step 7 (checkpoint {step})" in err and "finished" not in err
    rundir.mark_done(d)
    rundir.prepare_run_dir(d, cfg, kind="rl")
    err = capsys.readouterr().err
    assert "from step 7" in err and "finished, nothing to do" in err


def test_done_run_records_its_end_time(tmp_path):
    """mark_done writes meta.json's end_time (analysis/gputime.py's job end) before the done marker."""
    d = rundir.prepare_run_dir(tmp_path / "run", C.load_config(None, []), kind="rl")
    meta = json.loads((d / "meta.json").read_text())
    assert "end_time" not in meta and {"gpu_device", "host_gpus", "boot_id"} <= set(meta)
    rundir.mark_done(d, {"steps": 3})
    after = json.loads((d / "meta.json").read_text())
    assert after["end_time"] >= after["start_time"] and after == {**meta, "end_time": after["end_time"]}
    assert json.loads((d / "done").read_text()) == {"steps": 3}
    # started again (a finished run: nothing to do): that attempt's end is kept apart from the next's
    rundir.prepare_run_dir(d, C.load_config(None, []), kind="rl")
    again = json.loads((d / "meta.json").read_text())
    assert again["attempt_ends"] == [after["end_time"]] and len(again["resumes"]) == 1 and "end_time" not in again


def test_bad_inputs_create_no_run_dir(tmp_path):
    """An unknown model is refused when the config is loaded (the registry's names), before any run dir."""
    with pytest.raises(C.ConfigError, match="config key 'model': unknown model 'qwen9_moe-tiny'"):
        cfg = C.load_config(None, ["model=qwen9_moe-tiny"])
        rundir.prepare_run_dir(tmp_path / "run", cfg, kind="sft")
    assert not (tmp_path / "run").exists()


def test_meta_git_tree_names_the_files_on_disk():
    """meta.json's git_tree is the tree of the tracked files as they are, also when they differ from HEAD
    (a copy holding a newer commit's files beside an older .git: git_commit alone would name the old one)."""
    import subprocess

    tree = rundir._git_tree()
    if tree is None:
        pytest.skip("not a git checkout")
    path = "trace/rundir.py"
    blob = subprocess.run(["git", "-C", rundir._ROOT, "ls-tree", tree, path], capture_output=True, text=True,
                          check=True).stdout.split()[2]
    on_disk = subprocess.run(["git", "-C", rundir._ROOT, "hash-object", path], capture_output=True, text=True,
                             check=True).stdout.strip()
    assert blob == on_disk
    assert json.loads(json.dumps(rundir.collect_meta()))["git_tree"] == tree


def test_meta_git_commit_from_the_launcher(monkeypatch):
    """The launcher names its commit (TRACE_GIT_COMMIT) where a copy's .git is older than its files."""
    monkeypatch.setenv("TRACE_GIT_COMMIT", "0123abc")
    assert rundir.collect_meta()["git_commit"] == "0123abc"
    monkeypatch.delenv("TRACE_GIT_COMMIT")
    assert rundir.collect_meta()["git_commit"] != "0123abc"


def test_meta_records_the_rollout_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("TRACE_FP4_CROSSOVER", "inf,inf")
    monkeypatch.delenv("TRACE_ROLLOUT_BACKEND", raising=False)
    assert rundir.collect_meta()["env"] == {"TRACE_FP4_CROSSOVER": "inf,inf"}


def test_note_meta_keeps_a_resumed_run_on_its_first_choice(tmp_path):
    import json

    from trace.config import ConfigError
    (tmp_path / "meta.json").write_text(json.dumps({"kind": "sft"}))
    rundir.note_meta(tmp_path, "sft_attention", "math")
    rundir.note_meta(tmp_path, "sft_attention", "math")
    assert json.loads((tmp_path / "meta.json").read_text()) == {"kind": "sft", "sft_attention": "math"}
    with pytest.raises(ConfigError, match="resume it as it started"):
        rundir.note_meta(tmp_path, "sft_attention", "auto")


def test_sigint_guard_keeps_an_interrupt_a_finalizer_swallowed():
    """Python prints and ignores a KeyboardInterrupt raised inside `__del__`; the guard's flag makes the
    training loop's step-boundary check raise it again, and the previous handler comes back on exit."""
    import gc
    import signal

    class Swallowing:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)  # the handler runs here: its KeyboardInterrupt is ignored

    before = signal.getsignal(signal.SIGINT)
    with rundir.SigintGuard() as guard:
        guard.check()  # nothing pending
        x = Swallowing()
        del x
        gc.collect()
        assert guard.requested
        with pytest.raises(KeyboardInterrupt):
            guard.check()
    assert signal.getsignal(signal.SIGINT) is before
