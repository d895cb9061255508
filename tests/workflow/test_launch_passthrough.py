"""workflow/scripts/launch.py hands the flags after its `--` (a profile's openrlhf_flags) to the rl command after
`--`, last; they are part of the run dir's config stamp (other flags: a fresh run dir, as another config); for the
other stages they are refused."""
from __future__ import annotations

import json
import sys

import pytest

from workflow.scripts import launch

# a trainer that records its argv in the run dir and marks it done
TRAINER = (f"{sys.executable} -c 'import json, sys; d = sys.argv[sys.argv.index(\"--out\") + 1]; "
           "json.dump(sys.argv[1:], open(d + \"/argv.json\", \"w\")); open(d + \"/done\", \"w\"); "
           "open(d + \"/ckpt\", \"w\")'")


@pytest.fixture
def clean(monkeypatch):
    for k in ("TRACE_ALLOW_DIRTY", "TRACE_GIT_COMMIT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(launch, "tracked_diff", lambda: "")


def _rl(tmp_path, *extra):
    (tmp_path / "rl.yaml").write_text("seed: 0\n")
    out = tmp_path / "run"
    rc = launch.main(["--stage", "rl", "--cmd", TRAINER, "--config", str(tmp_path / "rl.yaml"), "--out", str(out),
                      "--set", "rl.steps=2", *extra])
    return rc, out


def test_flags_after_dashdash_follow_the_command(tmp_path, clean):
    rc, out = _rl(tmp_path, "--", "--ckpt.max_num", "1", "--actor.gradient_checkpointing_enable")
    assert rc == 0
    argv = json.loads((out / "argv.json").read_text())
    assert argv[argv.index("--out") + 1:] == [str(out), "--set", "rl.steps=2", "--", "--ckpt.max_num", "1",
                                          "--actor.gradient_checkpointing_enable"]
    stamp = (out / launch.STAMP).read_text().strip()
    assert stamp == launch.config_digest(str(tmp_path / "rl.yaml"), ["--ckpt.max_num", "1",
                                                                      "--actor.gradient_checkpointing_enable"])
    assert stamp != launch.sha256(str(tmp_path / "rl.yaml"))


def test_no_flags_no_dashdash_and_the_plain_stamp(tmp_path, clean):
    rc, out = _rl(tmp_path)
    assert rc == 0 and "--" not in json.loads((out / "argv.json").read_text())
    assert (out / launch.STAMP).read_text().strip() == launch.sha256(str(tmp_path / "rl.yaml"))


def test_other_flags_wipe_the_run_dir(tmp_path, clean, capsys):
    _rl(tmp_path, "--", "--ckpt.max_num", "1")
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "run" / "done").unlink()
    rc, out = _rl(tmp_path, "--", "--ckpt.max_num", "2")
    assert rc == 0 and "wiping" in capsys.readouterr().out and not (out / "metrics.jsonl").exists()


def test_flags_refused_for_other_stages(tmp_path, clean, capsys):
    (tmp_path / "c.yaml").write_text("seed: 0\n")
    with pytest.raises(SystemExit):
        launch.main(["--stage", "sft", "--cmd", TRAINER, "--config", str(tmp_path / "c.yaml"),
                     "--out", str(tmp_path / "sft"), "--", "--ckpt.max_num", "1"])
    assert "apply to --stage rl only" in capsys.readouterr().err and not (tmp_path / "sft").exists()
