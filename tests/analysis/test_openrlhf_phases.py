"""analysis/openrlhf_phases.py on synthetic OpenRLHF run dirs: one row per run with its deployment, the medians of
its phases over the steps after the first, and embedded-trainer runs left out."""
import json

import pytest
import yaml

from analysis.openrlhf_phases import main, table


def _run(root, name, arm, *, gpus, ranks, colocate, engines=None, sync=(0.0, 0.5, 0.7, 0.6), kind="rl-openrlhf"):
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"rl": {"method": arm}}))
    (d / "meta.json").write_text(json.dumps({"kind": kind, "git_commit": "abc123def4567890", "gpu": "NVIDIA H200",
                                             "openrlhf_launch": {"gpus": gpus, "ranks": ranks, "colocate": colocate}}))
    if engines is not None:
        (d / "openrlhf_argv.json").write_text(json.dumps(["m", "--vllm.num_engines", "2", "--x", "--vllm.num_engines",
                                                          str(engines)]))
    lines = [{"step": 0, "eval_accuracy": 0.1}]  # the initial evaluation's line has no phases
    for i, s in enumerate(sync, start=1):
        lines.append({"step": i, "time_rollout_s": 10.0 * i, "time_sync_s": s, "time_train_s": 2.0,
                      "time_step_s": 10.0 * i + s + 2.0, "k3": 1e-4 * i, "rollout_gen_tokens_per_s": 100.0})
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    return d


def test_phases_per_run_after_the_first_step(tmp_path):
    _run(tmp_path, "colocated/trace", "trace", gpus=2, ranks=2, colocate=True)
    _run(tmp_path, "split/trace", "trace", gpus=1, ranks=1, colocate=False, engines=1)
    _run(tmp_path, "embedded/trace", "trace", gpus=1, ranks=1, colocate=True, kind="rl")
    df = table(str(tmp_path))
    assert list(df["run"]) == ["split/trace", "colocated/trace"]  # sorted by deployment; the embedded run is not one
    row = df.iloc[1]
    assert (row["gpus"], row["ranks"], row["engines"], bool(row["colocate"]), row["steps"]) == (2, 2, 2, True, 4)
    assert df.iloc[0]["engines"] == 1  # the last --vllm.num_engines of the argv (the user's, after TRACE's)
    # steps 2-4 (the first is warm-up): rollout 20, 30, 40; sync 0.5, 0.7, 0.6
    assert row["rollout_s"] == 30.0 and row["sync_s"] == 0.6 and row["train_s"] == 2.0
    assert row["step_s"] == pytest.approx(32.7) and row["k3"] == pytest.approx(3e-4)
    assert row["sync_frac"] == pytest.approx(0.6 / 32.7) and row["commit"] == "abc123def456"


def test_command_writes_csv_and_markdown(tmp_path):
    _run(tmp_path / "runs", "a", "bf16", gpus=2, ranks=2, colocate=True)
    assert main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "openrlhf_phases.md").read_text()
    assert "| a | bf16 | 2 | 2 | 2 | True | 4 |" in md
    assert (tmp_path / "out" / "openrlhf_phases.csv").read_text().startswith("run,arm,gpus,ranks,engines")
    with pytest.raises(SystemExit):
        table(str(tmp_path / "out"))  # no OpenRLHF runs there
