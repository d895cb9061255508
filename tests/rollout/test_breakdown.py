"""The rollout benchmark on the CPU: its step-time breakdown (attention / moe / sampling / other: every component is
measured; per decoded token, the prefill's share taken out) and its recording provider."""
import importlib.util
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location(
    "bench_rollout", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_rollout.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.mark.parametrize("prov", ["engine-bf16", "engine-w4a4-kv4"])
def test_breakdown_components_add_up(prov):
    model = bench.build("qwen3_moe-tiny", 4, "cpu", torch.float32, "eager", 64)
    prompts = torch.randint(5, 100, (2, 8), generator=torch.Generator().manual_seed(0)).tolist()
    eng = bench.make_engine(model, prov, prompts, 6, "cpu", torch.float32)
    parts, kernels = bench.breakdown(eng, prompts, 6, "cpu")
    assert kernels == {}  # kernel names come from the device trace (CUDA only)
    assert set(parts) == {"attention", "moe", "sampling", "other", "total"}
    # a difference of two CPU timings (6 tokens less the prefill's 1) may clamp to 0 on a loaded machine, so the
    # arithmetic is checked on given timings (test_breakdown_is_per_decoded_token_past_the_prefill); that every
    # label is measured is checked on one profiled call
    raw, _, ntok = bench._profile(eng, prompts, 6, "cpu")
    assert ntok == 2 * 6 and raw["attention"] > 0 and raw["moe"] > 0 and raw["sampling"] > 0


def test_breakdown_is_per_decoded_token_past_the_prefill(monkeypatch):
    """breakdown = (the profile of a `gen`-token generate - that of a 1-token one) / the difference in generated
    tokens, per component (a negative difference clamped to 0), and per kernel the same, largest first, `top` of
    them. Given timings: 12 tokens against 2 (10 decoded), attention 10 - 2 ms, moe 20 - 4, sampling 3 - 1, other
    7 - 9 (clamped)."""
    full = ({"attention": 10.0, "moe": 20.0, "sampling": 3.0, "other": 7.0},
            {"moe/gemm": 15.0, "attention/attn": 6.0, "other/copy": 1.0, "moe/route": 2.0}, 12)
    pre = ({"attention": 2.0, "moe": 4.0, "sampling": 1.0, "other": 9.0},
           {"moe/gemm": 3.0, "attention/attn": 1.0, "other/copy": 2.0}, 2)
    calls = []
    monkeypatch.setattr(bench, "_profile", lambda eng, prompts, gen, device: calls.append(gen) or
                        (full if gen == 6 else pre))
    eng = type("Eng", (), {"cuda_graphs": True, "generate": lambda self, *a, **k: None})()
    parts, kernels = bench.breakdown(eng, [[1, 2]], 6, "cpu", top=2)
    assert calls == [6, 1] and eng.cuda_graphs is False
    assert parts == pytest.approx({"attention": 0.8, "moe": 1.6, "sampling": 0.2, "other": 0.0, "total": 2.6})
    assert list(kernels) == ["moe/gemm", "attention/attn"] and kernels == pytest.approx({"moe/gemm": 1.2,
                                                                                         "attention/attn": 0.5})


def test_record_provider_times_a_recorded_generate(tmp_path):
    """engine-w4a4-kv4-record: the same generate with trace's guidance record made and finished in the clock."""
    import csv

    out = tmp_path / "r.csv"
    bench.main(["--models", "qwen3_moe-tiny", "--batch", "2", "--prompt", "8", "--gen", "6", "--device", "cpu",
                "--providers", "engine-w4a4-kv4", "engine-w4a4-kv4-record", "--out", str(out)])
    rows = {r["provider"]: r for r in csv.DictReader(out.open())}
    assert set(rows) == {"engine-w4a4-kv4", "engine-w4a4-kv4-record"}
    assert all(float(r["tokens_per_s"]) > 0 and r["note"] == "" for r in rows.values())
    assert bench.recorder_for("engine-w4a4-kv4-record", bench.build("qwen3_moe-tiny", 4, "cpu", torch.float32,
                                                                     "eager", 64)).layers == {2, 3}


def test_repeats_alternate_providers_and_give_paired_ratios(tmp_path, monkeypatch):
    """--repeats 3: each provider timed once per round, in provider order (BF16, FP4, BF16, FP4, ...); the row's
    tokens/s is the median round's and its note the rounds' range and the per-round ratios against BF16."""
    import csv

    order = []
    real = bench._generate
    monkeypatch.setattr(bench, "_generate", lambda eng, prov, *a: order.append((prov, a[-1])) or real(eng, prov, *a))
    out = tmp_path / "r.csv"
    bench.main(["--models", "qwen3_moe-tiny", "--batch", "2", "--prompt", "8", "--gen", "6", "--device", "cpu",
                "--providers", "engine-bf16", "engine-w4a4-kv4", "--repeats", "3", "--out", str(out)])
    timed = [p for p, n in order if n == 6]  # the warm-ups generate 2 tokens, the prefill timings 1
    assert timed == ["engine-bf16", "engine-w4a4-kv4"] * 3
    rows = {r["provider"]: r for r in csv.DictReader(out.open())}
    bf, fp = rows["engine-bf16"], rows["engine-w4a4-kv4"]
    assert "runs=3" in bf["note"] and "paired" not in bf["note"]
    note = dict(kv.split("=") for kv in fp["note"].split(";"))
    lo, hi = (float(x) for x in note["paired_ratio_range"].split("-"))
    assert note["runs"] == "3" and lo <= float(note["paired_ratio_median"]) <= hi
    lo, hi = (float(x) for x in note["tok_s_range"].split("-"))
    assert lo - 1 <= float(fp["tokens_per_s"]) <= hi + 1


def test_busy_time_counts_overlapping_device_work_once():
    """graph-busy: the union of the kernels', copies' and memsets' intervals; host events and gaps count nowhere."""
    ev = [dict(cat="kernel", ts=0.0, dur=100.0), dict(cat="kernel", ts=50.0, dur=100.0),  # overlap: 0-150
          dict(cat="gpu_memcpy", ts=140.0, dur=20.0), dict(cat="cpu_op", ts=0.0, dur=1e6),  # 150-160; host op ignored
          dict(cat="gpu_memset", ts=300.0, dur=10.0), dict(cat="kernel", ts=302.0, dur=3.0)]  # 300-310, nested
    assert bench.busy_ms(ev) == pytest.approx(0.170)
    assert bench.busy_ms([]) == 0.0


def test_device_parts_by_label_and_kernel(monkeypatch):
    """A kernel counts toward the label whose GPU-side span holds its start, else 'other'; per kernel name as well,
    and the kernels of a label add up to it."""
    ev = [dict(cat="gpu_user_annotation", name="rollout.attention", ts=0.0, dur=100.0),
          dict(cat="gpu_user_annotation", name="rollout.moe", ts=200.0, dur=100.0),
          dict(cat="kernel", name="attn", ts=10.0, dur=50.0), dict(cat="kernel", name="attn", ts=70.0, dur=20.0),
          dict(cat="kernel", name="gemm", ts=210.0, dur=30.0), dict(cat="gpu_memcpy", name="copy", ts=150.0, dur=4.0),
          dict(cat="cpu_op", name="host", ts=0.0, dur=1e6)]
    monkeypatch.setattr(bench, "_trace_events", lambda prof: ev)
    parts, kernels = bench._device_parts(None)
    assert parts == pytest.approx({"attention": 0.070, "moe": 0.030, "sampling": 0.0, "other": 0.004})
    assert kernels == pytest.approx({"attention/attn": 0.070, "moe/gemm": 0.030, "other/copy": 0.004})


def test_breakdown_prompts_reach_the_mean_context():
    ext = bench.extend_prompts([[1, 2, 3], [4]], 5)
    assert ext == [[1, 2, 3, 1, 2, 3, 1, 2], [4, 4, 4, 4, 4, 4]]
    assert bench.extend_prompts([[7, 8]], 0) == [[7, 8]]


@pytest.mark.slow
def test_batch_invariant_provider_runs_the_exact_arms_engine(tmp_path):
    """engine-w4a4-kv4-bi: the engine of the exact on-policy arm (batch-invariant kernels for every op), timed beside
    the default FP4 engine; here in Triton's interpreter, so only that it runs in that mode and writes its row."""
    import csv
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
    assert bench.engine_kwargs("engine-w4a4-kv4-bi") == dict(mode="w4a4", kv_fp4=True, fp4_backend="triton",
                                                             cuda_graphs=True, batch_invariant=True)
    assert not bench.engine_kwargs("engine-w4a4-kv4-triton")["batch_invariant"]
    out = tmp_path / "r.csv"
    bench.main(["--models", "qwen3_moe-tiny", "--batch", "2", "--prompt", "4", "--gen", "3", "--device", "cpu",
                "--providers", "engine-bf16", "engine-w4a4-kv4-bi", "--out", str(out)])
    rows = {r["provider"]: r for r in csv.DictReader(out.open())}
    assert set(rows) == {"engine-bf16", "engine-w4a4-kv4-bi"} and float(rows["engine-w4a4-kv4-bi"]["tokens_per_s"]) > 0
