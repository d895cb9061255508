"""benchmarks/engine_host_loop.py: the engine's per-step host time, on a few rows (the CPU is the host)."""
from benchmarks import engine_host_loop


def test_reports_the_generate_loops_own_time_per_step():
    r = engine_host_loop.main(["--rows", "8", "--new-tokens", "5"])
    assert r["steps"] == 5 and r["rows"] == 8
    # generate's own time is a part of the call's wall time, and the loop does work for every row and step
    assert 0 < r["host_ms_per_step"] < r["wall_ms_per_step"]
    assert r["host_us_per_row_step"] > 0
