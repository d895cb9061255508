"""The benchmark harness without a GPU: the long results tables are appended to (never overwritten) with
a fixed schema, the `triton_kernels` provider is skipped with an install hint when it cannot be
imported, and a timed tile variant is checked against the oracle before it is timed."""
import csv
import sys

import pytest

from benchmarks import anchor_triton_kernels as anchor
from benchmarks import bench_kernels as bk
from benchmarks.kernel_bench import harness
from benchmarks.results_table import KERNEL_FIELDS, ROLLOUT_FIELDS, append, read
from benchmarks.results_table import main as table_main


def _header(path):
    with open(path, newline="") as f:
        return next(csv.reader(f))


def test_append_keeps_old_rows_and_schema(tmp_path):
    p = str(tmp_path / "kernels.csv")
    append(p, [dict(version="v1", op="moe", median_us=10.0)], KERNEL_FIELDS)
    append(p, [dict(version="v2", op="moe", median_us=5.0), dict(version="v2", op="dense", median_us=1.5)],
           KERNEL_FIELDS)
    assert _header(p) == list(KERNEL_FIELDS)
    rows = read(p)
    assert [r["version"] for r in rows] == ["v1", "v2", "v2"]
    assert rows[0]["median_us"] == "10.0" and rows[0]["provider"] == ""


def test_append_widens_schema_without_losing_rows(tmp_path):
    p = str(tmp_path / "rollout.csv")
    append(p, [dict(version="a", tokens_per_s=1.0)], ROLLOUT_FIELDS)
    append(p, [dict(version="b", tokens_per_s=2.0, new_col="x")], ROLLOUT_FIELDS)
    h = _header(p)
    assert h[:len(ROLLOUT_FIELDS)] == list(ROLLOUT_FIELDS) and h[-1] == "new_col"
    rows = read(p)
    assert [(r["version"], r["new_col"]) for r in rows] == [("a", ""), ("b", "x")]


def test_table_cli_appends_run_tables(tmp_path):
    run, home = str(tmp_path / "run.csv"), str(tmp_path / "kernels.csv")
    append(home, [dict(version="old")], KERNEL_FIELDS)
    append(run, [dict(version="new", op="moe"), dict(version="new", op="dense")], KERNEL_FIELDS)
    table_main([run, "--into", home])
    assert [r["version"] for r in read(home)] == ["old", "new", "new"]


def test_cli_widens_only_by_the_run_tables_columns(tmp_path):
    """A trainer-step table gains the run's new columns, never the kernel table's."""
    run, home = str(tmp_path / "run.csv"), str(tmp_path / "trainer_step.csv")
    append(home, [dict(version="old", arm="trace", step_s=1.0)], ("version", "arm", "step_s"))
    append(run, [dict(version="new", arm="trace", step_s=2.0, procs=4)], ("version", "arm", "step_s", "procs"))
    table_main([run, "--into", home])
    assert _header(home) == ["version", "arm", "step_s", "procs"]
    assert [r["procs"] for r in read(home)] == ["", "4"]


def test_bench_rows_follow_the_schema(tmp_path, monkeypatch):
    p = str(tmp_path / "k.csv")
    monkeypatch.setattr(harness, "ROWS", [])
    monkeypatch.setitem(bk.STATE, "out", p)
    monkeypatch.setitem(bk.STATE, "copy_gbps", 4000.0)
    monkeypatch.setattr(harness, "RUN", dict(version="vX", commit="abc", gpu="GPU", date="2026-01-01"))
    # 1 ms for 2 GB = 2000 GB/s = 50% of copy; BF16 took 3 ms, the anchor 2 ms
    bk.record("moe", "fam T16", "fp4-w4a16", (1.0, 0.9, 1.1), 2e9, base_ms=3.0, anchor_ms=2.0)
    bk.check("a check", False, "detail")
    rows = read(p)
    assert _header(p) == list(KERNEL_FIELDS)
    r = rows[0]
    assert (r["version"], r["commit"], r["gpu"], r["date"]) == ("vX", "abc", "GPU", "2026-01-01")
    assert float(r["median_us"]) == pytest.approx(1000.0)
    assert float(r["ratio_vs_bf16"]) == pytest.approx(3.0) and float(r["ratio_vs_anchor"]) == pytest.approx(2.0)
    assert float(r["gb_per_s"]) == pytest.approx(2000.0) and float(r["pct_copy_bw"]) == pytest.approx(50.0)
    assert rows[1]["op"] == "check" and rows[1]["ok"] == "False"


def test_anchor_provider_skipped_with_install_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "triton_kernels", None)  # import raises ImportError
    monkeypatch.setattr(anchor, "_MSG", [])
    p = str(tmp_path / "k.csv")
    monkeypatch.setattr(harness, "ROWS", [])
    monkeypatch.setitem(bk.STATE, "out", p)
    assert bk.load_anchor() is None
    out = capsys.readouterr().out
    assert "triton_kernels provider skipped" in out and "pip install" in out
    (row,) = read(p)
    assert row["op"] == "anchor" and "pip install" in row["note"]


def test_timed_variants_are_checked_against_the_oracle_first(tmp_path, monkeypatch):
    """`timed_best` with an oracle: a variant whose output misses it gets a failed check row and is not timed;
    the fastest of the others is returned (how the `fp4-w4a16-mma` / `fp4-w4a4-mma` rows are made)."""
    import torch

    from kernels.gemm import GemmConfig

    p = str(tmp_path / "k.csv")
    monkeypatch.setattr(harness, "ROWS", [])
    monkeypatch.setitem(bk.STATE, "out", p)
    r = torch.ones(4)
    outs, times, timed = {8: 1.5 * r, 16: r, 32: (1 + 1e-3) * r}, {8: 1.0, 16: 3.0, 32: 2.0}, []

    def fn_of_cfg(c):
        def fn():
            return outs[c.BKW]
        fn.bkw = c.BKW
        return fn

    def bench(fn):
        timed.append(fn.bkw)
        return times[fn.bkw], times[fn.bkw], times[fn.bkw]

    monkeypatch.setattr(harness, "bench", bench)
    t, cfg = bk.timed_best(fn_of_cfg, [GemmConfig(BKW=b) for b in (8, 16, 32)], "dense", "M1", "fp4-w4a16-mma",
                           None, oracle=(r, 1e-2))
    assert timed == [16, 32] and cfg.BKW == 32 and t[0] == 2.0
    checks = [row for row in read(p) if row["op"] == "check"]
    assert [c["ok"] for c in checks] == ["False", "True", "True"]
    assert all(c["shape"].startswith("dense M1 fp4-w4a16-mma") for c in checks)


def test_mma_variants_are_mma_tiles_with_the_bf16_decode():
    """The tiles timed beside the decode GEMV: the MMA config first, then distinct MMA tiles with the bf16
    decode (the fp32 decode only in --sweep)."""
    import torch

    from kernels.gemm import default_config
    from kernels.moe import mma_moe_config

    dense = default_config(1, 4096, 4096, torch.device("cpu"))
    for vs, d in ((bk.mma_variants(dense), dense), (bk.mma_variants(mma_moe_config(1, 8, 128)),
                                                          mma_moe_config(1, 8, 128))):
        assert vs[0] == d and len(set(vs)) == len(vs) >= len(bk.MMA_TILES)
        assert all(c.kind == "mma" and c.bf16_decode for c in vs)
