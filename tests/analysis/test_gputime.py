"""analysis.gputime: job intervals, their union and GPU-seconds per device, on synthetic run dirs (made-up
times in seconds after an epoch; every expected number is worked out in the test's docstring)."""
import datetime as dt
import json

import pytest

from analysis.gputime import build, gpu_shares, gputime_table, load_jobs, union_length

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def _t(s: float) -> str:
    return (T0 + dt.timedelta(seconds=s)).isoformat()


def _meta(start, end=None, device=None, host_gpus=None, boot="a", cpu_count=16, gpu=True, commit="c1"):
    m = {"git_commit": commit, "hostname": "vm", "cpu_count": cpu_count, "gpu": ["NVIDIA H200"] if gpu else None,
         "start_time": _t(start)}
    if end is not None:  # recorded: placement and end time, as trace/rundir.py writes them now
        m.update(end_time=_t(end), gpu_device=device, host_gpus=host_gpus, boot_id=boot)
    return m


def _run(runs, model, task, arm, seed, meta, step_s=(), eval_meta=None, done_steps=None):
    d = runs / model / task / arm / (f"seed{seed}" if arm != "sft" else "")
    d.mkdir(parents=True, exist_ok=True)
    (d / "meta.json").write_text(json.dumps({**meta, "kind": "sft" if arm == "sft" else "rl"}))
    lines = [{"step": 0, "eval_accuracy": 0.1}] if arm != "sft" else []  # RL's step 0: no time_step_s
    lines += [{"step": i + 1, "time_step_s": s} for i, s in enumerate(step_s)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (d / "done").write_text(json.dumps({"steps": done_steps or len(step_s)}) + "\n")
    if eval_meta is not None:
        (d / "eval.json").write_text(json.dumps({"bf16": {"accuracy": 0.5}, "fp4": {"accuracy": 0.5}, "meta": eval_meta}))


def _ev(start, end, device, host_gpus=2, boot="a"):
    return {"gpu": ["NVIDIA H200"], "hostname": "vm", "cpu_count": 16, "start_time": _t(start), "end_time": _t(end),
            "gpu_device": device, "host_gpus": host_gpus, "boot_id": boot}


def test_union_of_overlapping_touching_disjoint_and_empty_intervals():
    assert union_length([(20, 25), (0, 10), (5, 15), (25, 30), (40, 40)]) == 25
    assert union_length([]) == 0


def test_recorded_devices_two_gpus_and_a_second_machine(tmp_path):
    """Machine a (2 GPUs). Device 0: SFT m1 [0, 100], RL m1 seed0 [100, 400], m1 seed1's evaluation [300, 320],
    RL m2 seed0 [200, 500]: busy [0, 500] = 500 s. Device 1: RL m1 seed1 [100, 300], m1 seed0's evaluation
    [400, 450]: 250 s. Machine b (same hostname, another boot, 1 GPU): RL m2 seed1 [0, 100] at the same time
    as machine a: 100 s. Total 850 GPU-s, wall [0, 500] = 500 s.
    Shares of device 0: SFT 100; m1 seed0 100 + 100/2 + 20/3 + 80/2 = 196.67; m2 seed0 the same; the
    evaluation 20/3. m1: 100 + 196.67 + 50 (its eval on device 1) + 200 + 6.67 = 553.33 GPU-s, of which the
    RL runs and their evaluations 453.33 over 2 x 3 steps = 75.56 per step; wall [0, 450]. m2: 196.67 + 100 =
    296.67, wall [0, 100] + [200, 500] = 400."""
    runs = tmp_path / "runs" / "small"
    _run(runs, "m1", "reasoning", "sft", 0, _meta(0, 100, "0", 2), step_s=[0.1, 0.1])
    _run(runs, "m1", "reasoning", "bf16", 0, _meta(100, 400, "0", 2), step_s=[90, 90, 90], eval_meta=_ev(400, 450, "1"))
    _run(runs, "m1", "reasoning", "bf16", 1, _meta(100, 300, "1", 2), step_s=[60, 60, 60], eval_meta=_ev(300, 320, "0"))
    _run(runs, "m2", "reasoning", "bf16", 0, _meta(200, 500, "0", 2), step_s=[90, 90, 90])
    _run(runs, "m2", "reasoning", "bf16", 1, _meta(0, 100, "0", 1, boot="b"), step_s=[30, 30, 30])
    jobs = load_jobs(str(runs))
    assert len(jobs) == 7 and sum(gpu_shares(jobs)) == pytest.approx(850)
    t = gputime_table(jobs).set_index("model")
    assert t.loc["m1", "gpu_s"] == pytest.approx(553.333, abs=1e-3) and t.loc["m1", "wall_s"] == 450
    assert t.loc["m1", "rl_steps"] == 6 and t.loc["m1", "gpu_s_per_rl_step"] == pytest.approx(453.333 / 6, abs=1e-3)
    assert t.loc["m1", "sft_s"] == 100 and t.loc["m1", "evaluations"] == 2
    assert t.loc["m2", "gpu_s"] == pytest.approx(296.667, abs=1e-3) and t.loc["m2", "wall_s"] == 400
    assert t.loc["all", "gpu_s"] == pytest.approx(850) and t.loc["all", "wall_s"] == 500
    assert t.loc["all", "gpus_per_machine"] == "1/2"


@pytest.mark.parametrize("cpu_count,gpu_s", [(32, 500), (16, 400)])
def test_legacy_runs_end_at_their_evaluation_and_spread_over_the_gpus(tmp_path, cpu_count, gpu_s):
    """Runs with start times only (the committed ones before end times were recorded). RL seed0 starts at 50,
    its evaluation ended at 300 (eval.json's meta start_time, taken after the evaluation): [50, 300]. seed1
    starts at 60, no evaluation: start + its step times 20 + 30 + 50 = [60, 160]. seed2 at 400, evaluation
    ended at 500: [400, 500]. The SFT (start 0) ends at the first RL start after it from its commit (50; its
    own evaluation ended at 120, later): [0, 50]; that evaluation counts as no time. A CPU run is left out.
    Wall [0, 300] + [400, 500] = 400. cpu_count 32 = 2 GPUs, jobs spread: [60, 160] has 2 jobs on 2 GPUs,
    every other moment 1, so 400 + 100 = 500 GPU-s; with 16 cores (1 GPU) 400. seed4, from another commit
    at 1000 with no evaluation ([1000, 1003]), adds 3 s and 3 steps and does not end the SFT. Per RL step: all
    but the SFT's 50 GPU-s over 12 steps."""
    runs = tmp_path / "runs" / "small"
    m = lambda s: _meta(s, cpu_count=cpu_count)  # noqa: E731
    _run(runs, "m", "t", "sft", 0, m(0), step_s=[0.4, 0.6], done_steps=100, eval_meta=m(120))
    _run(runs, "m", "t", "bf16", 0, m(50), step_s=[20, 30, 50], eval_meta=m(300))
    _run(runs, "m", "t", "bf16", 1, m(60), step_s=[20, 30, 50])
    _run(runs, "m", "t", "bf16", 2, m(400), step_s=[20, 30, 50], eval_meta=m(500))
    _run(runs, "m", "t", "bf16", 3, _meta(0, gpu=False), step_s=[1000, 1000, 1000])
    _run(runs, "m", "t", "bf16", 4, _meta(1000, commit="c2", cpu_count=cpu_count), step_s=[1, 1, 1])
    t = gputime_table(load_jobs(str(runs))).set_index("model")
    assert t.loc["m", "sft_s"] == 50 and t.loc["m", "wall_s"] == 403
    assert t.loc["m", "gpu_s"] == pytest.approx(gpu_s + 3)
    assert t.loc["m", "rl_steps"] == 12 and t.loc["m", "evaluations"] == 3
    assert t.loc["m", "gpu_s_per_rl_step"] == pytest.approx((gpu_s + 3 - 50) / 12)


def test_resumed_attempts_end_at_their_recorded_end_or_the_next_start(tmp_path):
    """Seed 0 finished at 50 and was started again at 1000 (nothing to do, ended 1010): [0, 50] + [1000, 1010]
    = 60 s, not the 1,010 s from first start to last end. Seed 1 was killed (no end) and resumed at 200:
    [100, 200] + [200, 300] = 200 s. One GPU, no overlap: 260 GPU-s."""
    runs = tmp_path / "runs" / "small"
    m0 = {**_meta(0, 1010, "0", 1), "resumes": [_t(1000)], "attempt_ends": [_t(50)]}
    m1 = {**_meta(100, 300, "0", 1), "resumes": [_t(200)], "attempt_ends": [None]}
    _run(runs, "m", "t", "bf16", 0, m0, step_s=[10])
    _run(runs, "m", "t", "bf16", 1, m1, step_s=[10])
    t = gputime_table(load_jobs(str(runs))).set_index("model")
    assert t.loc["m", "wall_s"] == 260 and t.loc["m", "gpu_s"] == 260


def test_sft_without_a_dependent_job_ends_after_its_steps(tmp_path):
    """A legacy SFT alone: 100 steps at the mean logged step time (0.4 + 0.6) / 2 = 0.5 s: 50 s."""
    runs = tmp_path / "runs" / "small"
    _run(runs, "m", "t", "sft", 0, _meta(0), step_s=[0.4, 0.6], done_steps=100)
    t = gputime_table(load_jobs(str(runs))).set_index("model")
    assert t.loc["m", "sft_s"] == 50 and t.loc["m", "gpu_s"] == 50


def test_a_profile_run_on_the_cpu_gets_an_empty_table(tmp_path):
    runs = tmp_path / "runs" / "smoke"
    _run(runs, "m", "t", "bf16", 0, _meta(0, gpu=False), step_s=[1, 1])
    t = build(str(runs), str(tmp_path / "tables"))
    assert list(t["model"]) == ["all"] and t.loc[0, "gpu_s"] == 0
    md = (tmp_path / "tables" / "gputime.md").read_text()
    assert md.startswith("### GPU time (smoke profile)") and "no job of the smoke profile lists a GPU" in md
