"""The rollout engine's crossover table from one benchmark run: per decode size, which W4A4 path is fastest.

What: reads the rows of one version of results/kernels/kernels.csv (written by benchmarks/bench_kernels.py)
and, for every MoE layer (family x T tokens) and dense GEMM (shape x M rows) it timed, sets the three paths
a decode step can take side by side: the decode GEMV kernel (`fp4-w4a4` where the default config is the
GEMV), the MMA kernel (the fastest of `fp4-w4a4` where the default is MMA, `fp4-w4a4-mma` and, in version
v3a's rows, `fp4-w4a4-mma3`, today's tile; in version v3c's rows `fp4-w4a4-dec` alone, the tile on the
decoded activation, which every later version's MMA rows run) and the quantize kernel's
codes into BF16 GEMMs on the dequantized weights (`w4a4-bf16gemm`, what the engine runs above its
crossover). It names the fastest and derives the engine's two limits (trace/rollout/fast.py `crossover`):
the largest dense row count and the largest (token, slot) rows per expert up to which a kernel wins at
every timed size of every shape (the limits are shared by all shapes); and, for the default configs'
GEMV / MMA boundary (kernels.gemm.auto_config, kernels.moe.default_moe_config), the largest size up to which
the GEMV beat the MMA tile at every shape where both were timed and the sizes where the shapes disagree.

Run: `python benchmarks/crossover.py --version v3b [--csv results/kernels/kernels.csv] [--out FILE.md]`.
Compared against: nothing; the inputs are same-run medians (the benchmark's own comparisons).
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_kernels import FAMILIES  # noqa: E402

PATHS = ("GEMV", "MMA", "BF16 GEMM")


def _load(path: str, version: str) -> dict[tuple[str, str], dict[str, float]]:
    """{(op, shape): {provider: median us}} of one version's moe / dense rows."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["version"] != version or r["op"] not in ("moe", "dense") or not r["median_us"]:
                continue
            out.setdefault((r["op"], r["shape"]), {})[r["provider"]] = float(r["median_us"])
    return out


def _paths(prov: dict[str, float], load: float, legacy: bool) -> dict[str, float]:
    """The three paths' times (us) at one size; a path not timed there is left out. The benchmark times the
    MMA tile (`fp4-w4a4-mma`) beside the default where the default is the GEMV; legacy: a run from before it
    did (versions up to v3a), whose default took the GEMV up to 8 rows (per expert)."""
    t: dict[str, float] = {}
    if "fp4-w4a4" in prov:
        gemv = load <= 8 if legacy else "fp4-w4a4-mma" in prov
        t["GEMV" if gemv else "MMA"] = prov["fp4-w4a4"]
    for name in ("fp4-w4a4-mma", "fp4-w4a4-mma3"):  # -mma3: version v3a's rows of today's MMA tile
        if name in prov:
            t["MMA"] = min(t.get("MMA", math.inf), prov[name])
    if "fp4-w4a4-dec" in prov:  # version v3c: today's MMA tile (the decoded activation); the rows above decode codes
        t["MMA"] = prov["fp4-w4a4-dec"]
    if "fp4-w4a4-gemv" in prov:  # from version v5k the dense default is the MMA tile and the GEMV has its own rows
        t["GEMV"] = prov["fp4-w4a4-gemv"]
    if "w4a4-bf16gemm" in prov:
        t["BF16 GEMM"] = prov["w4a4-bf16gemm"]
    return t


def table(path: str, version: str) -> tuple[list[dict], dict]:
    """-> (rows: op, shape, size, load (rows per expert or rows), the paths' us and the fastest; limits:
    "dense_rows" / "moe_load", the largest size up to which a kernel won everywhere ("..._open": no timed size
    lost); "gemv_dense_rows" / "gemv_moe_load", the largest size up to which the GEMV beat the MMA tile at every
    shape timed with both; "split_dense_rows" / "split_moe_load", the sizes where the shapes disagree on that)."""
    rows = []
    data = _load(path, version)
    legacy = not any("fp4-w4a4-mma" in prov for prov in data.values())
    for (op, shape), prov in data.items():
        if op == "moe":
            fam, size = shape.split()[0], int(shape.split()[1].lstrip("T"))
            _, _, E, k = FAMILIES[fam]
            load = size * k / E
        else:
            size = int(shape.split()[0].lstrip("M"))
            load = float(size)
        t = _paths(prov, load, legacy)
        if "BF16 GEMM" not in t or len(t) < 2:
            continue
        best = min(t, key=t.get)
        rows.append(dict(op=op, shape=shape, size=size, load=load, best=best, **{p: t.get(p) for p in PATHS}))
    rows.sort(key=lambda r: (r["op"], r["shape"].split()[0] if r["op"] == "moe" else r["shape"].split(maxsplit=1)[1],
                             r["load"]))
    limits = {}
    for op, key in (("dense", "dense_rows"), ("moe", "moe_load")):
        mine = [r for r in rows if r["op"] == op]
        lost = [r["load"] for r in mine if r["best"] == "BF16 GEMM"]
        won = [r["load"] for r in mine if r["best"] != "BF16 GEMM" and (not lost or r["load"] < min(lost))]
        limits[key] = max(won) if won else 0.0
        limits[key + "_open"] = bool(mine) and not lost  # no timed size lost: the limit is at least this
        both = [r for r in mine if r["GEMV"] is not None and r["MMA"] is not None]
        gemv_won = {r["load"] for r in both if r["GEMV"] < r["MMA"]}
        mma_won = {r["load"] for r in both if r["GEMV"] >= r["MMA"]}
        limits["gemv_" + key] = max((v for v in gemv_won if v < min(mma_won, default=math.inf)), default=0.0)
        limits["split_" + key] = sorted(gemv_won & mma_won)  # sizes where the shapes disagree
    return rows, limits


def markdown(rows: list[dict], limits: dict, version: str) -> str:
    def us(v):
        return "n/a" if v is None else f"{v:.1f}"

    lines = [f"### Decode crossover (kernels.csv version {version}; W4A4, us, same-run medians)", "",
             "| op | shape | rows per expert / rows | GEMV | MMA | BF16 GEMM | fastest |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['shape']} | {r['load']:g} | {us(r['GEMV'])} | {us(r['MMA'])} | "
                     f"{us(r['BF16 GEMM'])} | {r['best']} |")
    def lim(key):
        return f"{limits[key]:g}" + (" (no timed size lost)" if limits[key + "_open"] else "")

    def split(key):
        return ", ".join(f"{v:g}" for v in limits["split_" + key]) or "none"

    lines += ["", f"Kernels win at every timed size up to: dense {lim('dense_rows')} rows, MoE "
              f"{lim('moe_load')} rows per expert (trace/rollout/fast.py DENSE_KERNEL_ROWS / MOE_KERNEL_LOAD, "
              "or TRACE_FP4_CROSSOVER=\"ROWS,LOAD\"). GEMV: the decode GEMV kernel; MMA: the tensor-core kernel "
              "(best of its timed tiles where the GEMV is the default; version v3c: its `fp4-w4a4-dec` rows, the default "
              "tile on the decoded activation); BF16 GEMM: the quantize kernel's codes on "
              "BF16 GEMMs with the dequantized weights. n/a: not timed at that size.", "",
              f"GEMV against MMA (the default configs' boundary, kernels.gemm.auto_config / "
              f"kernels.moe.default_moe_config): the GEMV won at every shape timed with both up to dense "
              f"{limits['gemv_dense_rows']:g} rows, MoE {limits['gemv_moe_load']:g} rows per expert; the shapes "
              f"disagree at dense {split('dense_rows')}, MoE {split('moe_load')} rows (per expert)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", required=True)
    ap.add_argument("--csv", default=str(ROOT / "results" / "kernels" / "kernels.csv"))
    ap.add_argument("--out", help="write the markdown table here (default: print it)")
    a = ap.parse_args(argv)
    rows, limits = table(a.csv, a.version)
    if not rows:
        sys.exit(f"no moe/dense rows with a BF16-GEMM comparison for version {a.version!r} in {a.csv}")
    md = markdown(rows, limits, a.version)
    if a.out:
        Path(a.out).write_text(md)
        print(f"wrote {a.out}")
    else:
        print(md, end="")


if __name__ == "__main__":
    main()
