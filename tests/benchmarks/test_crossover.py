"""benchmarks/crossover.py on a synthetic kernels.csv: the fastest path per size, the GEMV / MMA labels of
the default rows, and the limits (the largest size up to which a kernel won at every timed size)."""
import csv

from benchmarks.crossover import markdown, table

FIELDS = ["version", "commit", "gpu", "date", "op", "shape", "provider", "median_us", "config"]


def _csv(tmp_path, rows):
    path = tmp_path / "kernels.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for op, shape, prov, us in rows:
            w.writerow(dict(version="vX", commit="c", gpu="H200", date="d", op=op, shape=shape, provider=prov,
                            median_us=us, config=""))
        w.writerow(dict(version="old", commit="c", gpu="H200", date="d", op="moe", shape="qwen3-30b-a3b T1",
                        provider="w4a4-bf16gemm", median_us=1.0, config=""))  # another version: ignored
    return str(path)


def test_fastest_path_and_limits(tmp_path):
    # qwen3-30b-a3b: 128 experts, top-8 -> T=16 is 1 row per expert, T=256 16, T=1024 64
    rows = [("moe", "qwen3-30b-a3b T16", "fp4-w4a4", 50), ("moe", "qwen3-30b-a3b T16", "fp4-w4a4-mma", 40),
            ("moe", "qwen3-30b-a3b T16", "w4a4-bf16gemm", 90),
            ("moe", "qwen3-30b-a3b T256", "fp4-w4a4", 300), ("moe", "qwen3-30b-a3b T256", "w4a4-bf16gemm", 400),
            ("moe", "qwen3-30b-a3b T1024", "fp4-w4a4", 900), ("moe", "qwen3-30b-a3b T1024", "w4a4-bf16gemm", 700),
            ("dense", "M1 N14336 K4096", "fp4-w4a4", 30), ("dense", "M1 N14336 K4096", "w4a4-bf16gemm", 45),
            ("dense", "M16 N14336 K4096", "fp4-w4a4", 50), ("dense", "M16 N14336 K4096", "w4a4-bf16gemm", 45),
            ("dense", "M4 N14336 K4096", "fp4-w4a4", 60)]  # no BF16 row at M4: not comparable, left out
    got, limits = table(_csv(tmp_path, rows), "vX")
    by = {(r["op"], r["shape"]): r for r in got}
    assert ("dense", "M4 N14336 K4096") not in by
    t16 = by[("moe", "qwen3-30b-a3b T16")]
    assert t16["load"] == 1 and t16["GEMV"] == 50 and t16["MMA"] == 40 and t16["best"] == "MMA"
    t256 = by[("moe", "qwen3-30b-a3b T256")]
    assert t256["GEMV"] is None and t256["MMA"] == 300 and t256["best"] == "MMA"  # default above 8 rows: MMA
    assert by[("moe", "qwen3-30b-a3b T1024")]["best"] == "BF16 GEMM"
    assert limits["moe_load"] == 16 and not limits["moe_load_open"]
    assert limits["dense_rows"] == 1 and not limits["dense_rows_open"]
    md = markdown(got, limits, "vX")
    assert "| moe | qwen3-30b-a3b T16 | 1 | 50.0 | 40.0 | 90.0 | MMA |" in md
    assert "dense 1 rows, MoE 16 rows per expert" in md


def test_no_loss_is_an_open_limit(tmp_path):
    rows = [("dense", "M1 N14336 K4096", "fp4-w4a4", 30), ("dense", "M1 N14336 K4096", "w4a4-bf16gemm", 45)]
    _, limits = table(_csv(tmp_path, rows), "vX")
    assert limits["dense_rows"] == 1 and limits["dense_rows_open"]


def test_legacy_rows_take_the_old_gemv_limit(tmp_path):
    # a run from before the benchmark timed the MMA tile beside the GEMV: its default ran the GEMV up to 8 rows
    rows = [("dense", "M4 N14336 K4096", "fp4-w4a4", 30), ("dense", "M4 N14336 K4096", "w4a4-bf16gemm", 45),
            ("dense", "M16 N14336 K4096", "fp4-w4a4", 40), ("dense", "M16 N14336 K4096", "w4a4-bf16gemm", 45)]
    got, _ = table(_csv(tmp_path, rows), "vX")
    by = {r["size"]: r for r in got}
    assert by[4]["GEMV"] == 30 and by[4]["MMA"] is None
    assert by[16]["MMA"] == 40 and by[16]["GEMV"] is None


def test_decoded_activation_rows_are_the_mma_tile(tmp_path):
    # version v3c timed today's MMA tile as `fp4-w4a4-dec` beside the tile that decoded the codes (`fp4-w4a4-mma`
    # where the default is the GEMV, `fp4-w4a4` where it is the MMA tile): the dec row alone is the MMA path
    rows = [("moe", "qwen3-30b-a3b T16", "fp4-w4a4", 50), ("moe", "qwen3-30b-a3b T16", "fp4-w4a4-mma", 40),
            ("moe", "qwen3-30b-a3b T16", "fp4-w4a4-dec", 45), ("moe", "qwen3-30b-a3b T16", "w4a4-bf16gemm", 90),
            ("moe", "qwen3-30b-a3b T256", "fp4-w4a4", 300), ("moe", "qwen3-30b-a3b T256", "fp4-w4a4-dec", 420),
            ("moe", "qwen3-30b-a3b T256", "w4a4-bf16gemm", 400)]
    got, limits = table(_csv(tmp_path, rows), "vX")
    by = {r["size"]: r for r in got}
    assert by[16]["GEMV"] == 50 and by[16]["MMA"] == 45 and by[16]["best"] == "MMA"
    assert by[256]["GEMV"] is None and by[256]["MMA"] == 420 and by[256]["best"] == "BF16 GEMM"
    assert limits["moe_load"] == 1 and not limits["moe_load_open"]


def test_gemv_mma_boundary_and_the_sizes_where_shapes_disagree(tmp_path):
    # qwen3 (128 experts, top-8) T4 / T16 = 0.25 / 1 row per expert; mixtral (8, top-2) T1 / T4 = 0.25 / 1
    rows = []
    for fam, T, gemv, mma in [("qwen3-30b-a3b", 4, 70, 90), ("qwen3-30b-a3b", 16, 185, 172),
                              ("mixtral-8x7b", 1, 147, 262), ("mixtral-8x7b", 4, 398, 427)]:
        shape = f"{fam} T{T}"
        rows += [("moe", shape, "fp4-w4a4", gemv), ("moe", shape, "fp4-w4a4-mma", mma),
                 ("moe", shape, "w4a4-bf16gemm", 999)]
    rows += [("dense", "M1 N14336 K4096", "fp4-w4a4", 33), ("dense", "M1 N14336 K4096", "fp4-w4a4-mma", 40),
             ("dense", "M1 N14336 K4096", "w4a4-bf16gemm", 48)]
    got, limits = table(_csv(tmp_path, rows), "vX")
    assert limits["gemv_moe_load"] == 0.25 and limits["split_moe_load"] == [1]
    assert limits["gemv_dense_rows"] == 1 and limits["split_dense_rows"] == []
    md = markdown(got, limits, "vX")
    assert "up to dense 1 rows, MoE 0.25 rows per expert; the shapes disagree at dense none, MoE 1 rows" in md
