"""figures.plot_rlstep on a synthetic results/rlstep/rlstep.csv: one panel per shape from its newest GPU run, phases
that add up to the step, a byte-identical redraw, and nothing written (no placeholder) without a GPU row."""
import csv
import hashlib

import pandas as pd

from benchmarks.bench_rlstep import FIELDS
from figures.plot_kernels import read_table
from figures.plot_rlstep import PHASES, phases, plot_rlstep, select

ARMS = ("bf16", "fp4-naive", "qat-independent", "trace", "trace-deep")


def _row(model, arm, version="v1", commit="abc", gpu="NVIDIA H200", kernels="auto", scale=1.0):
    fp4 = arm != "bf16"
    rec = {"trace": 0.3, "trace-deep": 0.15}.get(arm, 0.0)
    replay = {"trace": 0.4, "trace-deep": 0.2}.get(arm, 0.0)
    rollout = (6.0 if fp4 else 9.0) * scale + rec
    fwd_bwd = (5.0 if arm in ("qat-independent", "trace", "trace-deep") else 4.0) + replay
    train = fwd_bwd + 1.0
    r = dict.fromkeys(FIELDS, "")
    r.update(version=version, commit=commit, gpu=gpu, model=model, task="reasoning", arm=arm, fp4_kernels=kernels,
             batch=256, gen=1024, forced=True, rollout_s=rollout, generate_s=rollout - rec - 0.1, record_s=rec,
             train_s=train, fwd_bwd_s=fwd_bwd, replay_s=replay, optimizer_s=0.5, sync_s=0.3,
             step_s=rollout + train, tok_s=256 * 1024 / rollout, tok_s_vs_bf16=9.0 / rollout,
             train_vs_qat_independent=train / 6.0)
    return r


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


def _digest(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_panels_phases_and_stable_redraw(tmp_path):
    rows = [_row("qwen3_moe-medium", a, version="old", scale=3.0) for a in ARMS]  # an older run: not drawn
    rows += [_row(m, a) for m in ("qwen3_moe-medium", "mixtral-medium") for a in ARMS]
    rows += [_row("qwen3_moe-medium", "trace", kernels="off", scale=5.0)]  # the auto row is the one drawn
    rows += [_row("olmoe-medium", a, gpu="cpu") for a in ARMS]  # CPU rows never drawn
    _write(tmp_path / "rlstep.csv", rows)
    sel = select(read_table(str(tmp_path / "rlstep.csv")))
    assert sorted(sel["model"].unique()) == ["mixtral-medium", "qwen3_moe-medium"]
    assert len(sel) == 10 and set(sel["version"]) == {"v1"} and set(sel["fp4_kernels"]) == {"auto"}
    for _, r in sel.iterrows():
        p = phases(r)
        assert set(p) == set(PHASES) and min(p.values()) >= 0
        assert abs(sum(p.values()) - float(r["step_s"])) < 1e-9  # the phases are the step, nothing twice
        assert (p["replay"] > 0) == (r["arm"] in ("trace", "trace-deep")) and (p["record"] > 0) == (p["replay"] > 0)
    out = tmp_path / "figs"
    written = plot_rlstep(str(tmp_path / "rlstep.csv"), str(out))
    assert sorted(p.rsplit("/", 1)[1] for p in written) == ["rlstep.pdf", "rlstep.png"]
    png = (out / "rlstep.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and 300 < int.from_bytes(png[16:20], "big") <= 2600
    first = _digest(out)
    plot_rlstep(str(tmp_path / "rlstep.csv"), str(out))
    assert _digest(out) == first


def test_negative_replay_is_drawn_as_zero():
    r = pd.Series(_row("qwen3_moe-medium", "trace"))
    r["replay_s"] = -0.05  # the paired probe took longer than the step's forward+backward: noise
    assert phases(r)["replay"] == 0.0 and phases(r)["forward+backward"] > 0


def test_nothing_written_without_gpu_rows(tmp_path):
    out = tmp_path / "figs"
    assert plot_rlstep(str(tmp_path / "missing.csv"), str(out)) == []
    (tmp_path / "empty.csv").write_text(",".join(FIELDS) + "\n")
    assert plot_rlstep(str(tmp_path / "empty.csv"), str(out)) == []
    _write(tmp_path / "cpu.csv", [_row("qwen3_moe-medium", a, gpu="cpu") for a in ARMS])
    assert plot_rlstep(str(tmp_path / "cpu.csv"), str(out)) == []
    assert not out.exists()
