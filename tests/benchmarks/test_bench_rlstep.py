"""benchmarks/bench_rlstep.py on the CPU with a tiny model: one row per arm with the issue's columns, forced
length, phases that fit inside the step, the record's bytes only where there is a record (fewer with fewer
guided layers), the BF16 KV bytes of the model, ratios against bf16 and qat-independent (also across calls that
append to one table), and the --kernels and --procs variants."""
import csv
import types

import pytest

from benchmarks.bench_rlstep import FIELDS, PhaseClock, kv_bf16_bytes_per_token, main
from trace.models import build_config

BASE = ["--profile", "experiments/profiles/medium.yaml", "--model", "mixtral-tiny", "--task", "reasoning",
        "--prompts", "1", "--group-size", "2", "--device", "cpu"]


def test_rows_columns_and_phases(tmp_path):
    out = tmp_path / "r.csv"
    args = BASE + ["--gen", "6", "--steps", "2", "--out", str(out)]
    # in two calls that append to one table, as scripts/gpu/jobs/medium_rlstep.jobs splits the arms: the second call's
    # ratios take the first call's bf16 and qat-independent rows
    rows = main(args + ["--arms", "bf16", "qat-independent"])
    rows += main(args + ["--arms", "trace", "trace-deep"])
    assert [r["arm"] for r in rows] == ["bf16", "qat-independent", "trace", "trace-deep"]
    assert [r["method"] for r in rows] == ["bf16", "qat-independent", "trace", "trace"]
    assert [r["rho"] for r in rows] == ["", "", 1.0, 0.5]  # the profile's rho and its ablation arm's
    with open(out, newline="") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == list(FIELDS) and len(got) == 4
    kv = kv_bf16_bytes_per_token(build_config("mixtral-tiny"))
    assert kv == 2 * 4 * 1 * 32 * 2  # K and V x 4 layers x 1 KV head x head_dim 32 x 2 bytes
    for r in rows:
        assert r["batch"] == 2 and r["gen"] == 6 and r["forced"] is True and "forced" in r["note"]
        assert r["gen_per_seq"] == 6  # every sequence generated exactly --gen tokens
        assert r["rollout_s"] >= r["generate_s"] > 0 and r["tok_s"] == pytest.approx(12 / r["rollout_s"])
        assert r["step_s"] == pytest.approx(r["rollout_s"] + r["train_s"])
        # the timed pieces lie inside the train phase, each once
        assert r["fwd_bwd_s"] > 0 and r["optimizer_s"] > 0 and r["sync_s"] > 0
        assert r["fwd_bwd_s"] + r["optimizer_s"] + r["sync_s"] <= r["train_s"]
        assert r["kv_bf16_bytes_per_token"] == kv and r["peak_gb"] is None and r["k3_first"] is not None
        guided = r["arm"].startswith("trace")
        assert (r["record_s"] > 0) == guided and (r["record_bytes_per_token"] > 0) == guided
        assert r["record_frac"] == pytest.approx(r["record_s"] / r["rollout_s"])
        # replay: the paired probe ran only where the step replayed a record
        assert (r["replay_s"] != 0.0) == guided and r["replay_s"] < r["fwd_bwd_s"]
        # the repeated generate call: timed for arms without a record only
        assert (r["generate_again_s"] is None) == guided and (guided or r["generate_again_s"] > 0)
    bf16, qat, trace, deep = rows
    assert bf16["tok_s_vs_bf16"] == 1.0 and qat["train_vs_qat_independent"] == 1.0
    assert trace["tok_s_vs_bf16"] == round(trace["tok_s"] / bf16["tok_s"], 3)
    assert trace["train_vs_qat_independent"] == round(trace["train_s"] / qat["train_s"], 3)
    # the deepest half of the layers records fewer bytes than all of them (routing ids stay every layer's)
    assert 0 < deep["record_bytes_per_token"] < trace["record_bytes_per_token"]
    # --natural keeps the task's stops: the row says so, and no sequence generates more than --gen
    nat = main(BASE + ["--gen", "6", "--steps", "2", "--natural", "--arms", "bf16", "--out", str(tmp_path / "n.csv")])[0]
    assert nat["forced"] is False and "natural stops" in nat["note"] and 0 < nat["gen_per_seq"] <= 6


def test_micro_batch_option(tmp_path):
    """--micro-batch reaches rl.micro_batch: the row says so, every micro-batch's backward is in fwd_bwd_s and the
    replay probe runs over the same micro-batches."""
    r = main(BASE + ["--gen", "4", "--steps", "2", "--arms", "trace", "--micro-batch", "1",
                     "--out", str(tmp_path / "m.csv")])[0]
    assert r["micro_batch"] == 1 and r["batch"] == 2 and r["gen_per_seq"] == 4
    assert r["fwd_bwd_s"] > 0 and r["optimizer_s"] > 0 and r["fwd_bwd_s"] + r["optimizer_s"] <= r["train_s"]
    assert r["replay_s"] != 0.0 and r["replay_s"] < r["fwd_bwd_s"]


def test_forcing_drops_the_stops_and_nothing_else():
    """The clock's engine call keeps every argument but the stop token and stop string; --natural keeps them."""
    calls = []
    fake = types.SimpleNamespace(
        device="cpu", engine=types.SimpleNamespace(generate=lambda *a, **k: calls.append((a, k)), sync_weights=len),
        opt=types.SimpleNamespace(step=len), logprobs=len, policy_loss=len,
        train=types.SimpleNamespace(backward=len, apply=len))
    PhaseClock(fake, force=True).tr.engine.generate([[1, 2]], n=3, stop_token_ids=(2,), stop_strings=("\n\n",),
                                                    max_new_tokens=5)
    assert calls[-1] == (([[1, 2]],), {"n": 3, "stop_token_ids": (), "stop_strings": (), "max_new_tokens": 5})
    fake.engine.generate = lambda *a, **k: calls.append((a, k))
    clock = PhaseClock(fake, force=False)
    clock.tr.engine.generate([[1]], stop_token_ids=(2,), stop_strings=("\n\n",))
    assert calls[-1] == (([[1]],), {"stop_token_ids": (2,), "stop_strings": ("\n\n",)})
    # generate_again repeats the step's call as it was made, and not a call that fed a recorder
    assert clock.generate_again() > 0 and calls[-1] == calls[-2] and len(calls) == 3
    clock.tr.engine.generate([[1]], recorder=object())
    assert clock.generate_again() is None and len(calls) == 4


@pytest.mark.slow
def test_kernels_settings_and_processes(tmp_path):
    """--kernels: the FP4 arm once per setting, bf16 once, ratios against the same setting's reference and the
    same first k3 (the kernel path is the reference ops bit for bit); --procs 2: two processes at once, their
    median times and the throughput of both."""
    args = BASE + ["--gen", "4", "--steps", "2"]
    rows = main(args + ["--arms", "bf16", "qat-independent", "--kernels", "off", "on", "--out", str(tmp_path / "a.csv")])
    assert [(r["arm"], r["fp4_kernels"]) for r in rows] == [("bf16", "auto"), ("qat-independent", "off"),
                                                             ("qat-independent", "on")]
    assert rows[1]["train_vs_qat_independent"] == rows[2]["train_vs_qat_independent"] == 1.0
    assert rows[1]["k3_first"] == rows[2]["k3_first"]
    two = main(args + ["--arms", "qat-independent", "--kernels", "off", "--procs", "2", "--recompute-experts",
                       "--out", str(tmp_path / "b.csv")])[0]
    assert two["procs"] == 2 and two["steps_per_s"] == round(2 / two["step_s"], 4)
    assert two["recompute_experts"] is True and two["k3_first"] == rows[1]["k3_first"] and two["gen_per_seq"] == 4
