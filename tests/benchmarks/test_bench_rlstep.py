"""benchmarks/bench_rlstep.py on the CPU with a tiny model: one row per arm with the issue's columns, forced
length, phases that fit inside the step, the record's bytes only where there is a record (fewer with fewer
guided layers), the BF16 KV bytes of the model, ratios against bf16 and qat-independent (also across calls that
append to one table), and the --kernels and --procs variants. At a small flavor and the small-v2 profile: the
trainer's tokens and model FLOPs of the step (the PaLM formula restated here from the config), mfu and the peak
empty off a GPU; the alignment arms without a calibration file."""
import csv
import types

import pytest

import trace.rl.trainer as trainer_mod
from benchmarks.bench_rlstep import FIELDS, PhaseClock, kv_bf16_bytes_per_token, main
from trace.config import DEFAULTS
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


SMALL = ["--profile", "experiments/profiles/small-v2.yaml", "--model", "qwen3_moe-small", "--task", "reasoning",
         "--prompts", "2", "--group-size", "2", "--gen", "8", "--steps", "2", "--device", "cpu"]


def _palm_flops(c, seq_lens) -> int:
    """PaLM's model FLOPs of a forward+backward (Chowdhery et al. 2022, Appendix B) for a qwen3_moe config, written
    out: 6 x the matmul parameters a token passes through (q, k, v, o; the router; k experts' gate, up and down; the
    LM head) + 12 L H d_head T attention, per token of a sequence of T tokens."""
    per_layer = (2 * c.hidden_size * c.num_attention_heads * c.head_dim
                 + 2 * c.hidden_size * c.num_key_value_heads * c.head_dim
                 + c.hidden_size * c.num_experts
                 + c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size)
    n = c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size
    return sum(t * (6 * n + 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * t) for t in seq_lens)


def _trained_lengths(monkeypatch) -> list[list[int]]:
    """Per RL step, each sequence's prompt + generated tokens minus one (the last generated token is a target, never
    an input), from the rollout batch the trainer builds its train batch of."""
    steps = []
    build = trainer_mod.build_train_batch

    def spy(batch, *a, **k):
        steps.append([len(t) - 1 for t in batch.tokens])
        assert all(len(t) - p == 8 for t, p in zip(batch.tokens, batch.prompt_lens, strict=True))  # forced --gen
        return build(batch, *a, **k)

    monkeypatch.setattr(trainer_mod, "build_train_batch", spy)
    return steps


def test_small_flavor_flops_and_no_mfu_off_a_gpu(tmp_path, monkeypatch):
    steps = _trained_lengths(monkeypatch)
    out = tmp_path / "s.csv"
    r = main(SMALL + ["--arms", "bf16", "--out", str(out)])[0]
    assert len(steps) == 2 and len(steps[1]) == 4  # two steps of 2 prompts x 2 samples; the second is timed
    c = build_config("qwen3_moe-small")
    assert r["train_tokens"] == sum(steps[1])
    assert r["fwd_bwd_flops"] == _palm_flops(c, steps[1]) > 0
    assert r["experts"] == "loop" and r["micro_batch"] == 64  # auto on the CPU; the profile's micro-batch
    assert r["peak_tflops"] is None and r["mfu"] is None
    with open(out, newline="") as f:
        got = list(csv.DictReader(f))[0]
    assert got["peak_tflops"] == got["mfu"] == "" and float(got["fwd_bwd_flops"]) == r["fwd_bwd_flops"]


def test_mfu_is_the_rows_flops_over_time_and_peak():
    from benchmarks.flops import mfu
    assert mfu(4.0e12, 2.0, 500.0) == pytest.approx(4.0e12 / 2.0 / 500e12) == pytest.approx(0.004)
    assert mfu(4.0e12, 2.0, None) is None and mfu(4.0e12, 0.0, 500.0) is None


def test_trace_arm_without_a_calibration_file(tmp_path, monkeypatch):
    """The small-v2 profile's trace arm reads rl.align_coef from a calibration file; without one the benchmark runs
    it at the trainer's default coefficient and says so. Same prompts and forced length: the same trained tokens
    and model FLOPs as bf16. (The tiny flavor at the small-v2 profile: the small flavor's FP4 arms take minutes on
    the CPU under the tests' Triton interpreter.)"""
    args = ["--profile", "experiments/profiles/small-v2.yaml", "--model", "qwen3_moe-tiny", "--task", "reasoning",
            "--prompts", "1", "--group-size", "2", "--gen", "4", "--steps", "2", "--device", "cpu"]
    import runplan  # workflow/scripts, on the path through benchmarks.trainer_memory
    monkeypatch.setattr(runplan.Plan, "calibration_path", lambda self, rho: str(tmp_path / f"none_rho{rho:g}.json"))
    bf16, trace = main(args + ["--arms", "bf16", "trace", "--out", str(tmp_path / "t.csv")])
    default = f"align_coef {DEFAULTS['rl']['align_coef']:g}: the trainer's default"
    assert "align_coef" not in bf16["note"] and default in trace["note"]
    assert trace["rho"] == 1.0 and trace["record_bytes_per_token"] > 0 and trace["gen_per_seq"] == 4
    assert trace["train_tokens"] == bf16["train_tokens"] and trace["fwd_bwd_flops"] == bf16["fwd_bwd_flops"] > 0
    assert trace["mfu"] is None and trace["peak_tflops"] is None
