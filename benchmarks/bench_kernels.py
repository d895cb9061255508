"""GPU benchmark of the FP4 Triton kernels against PyTorch BF16 and OpenAI's `triton_kernels`, in one run.

What: (1) measures the copy-bandwidth ceiling; (2) checks every kernel on the GPU against
`kernels/reference.py` on fresh random data (bit-exact codes/scales for quantize; relative error for
GEMM / MoE / attention); (3) times each kernel, its PyTorch BF16 counterpart (cuBLAS `F.linear`,
`torch._grouped_mm`, SDPA) and, where installed, the `triton_kernels` MXFP4 kernels
(benchmarks/anchor_triton_kernels.py; skipped with a message otherwise) at the real layer shapes of the
four model families: MoE expert MLP at T = 1, 4, 16, 64, 256 tokens, dense decode at M = 1..64 rows;
(4) APPENDS one row per measurement and per check to the long table `--out` (default
results/kernels/kernels.csv; schema `benchmarks.results_table.KERNEL_FIELDS`): median/p20/p80 us,
ratio_vs_bf16 and ratio_vs_anchor (same-run medians: baseline / this), GB/s over the minimal bytes and
that as % of the copy bandwidth measured at the start of the run.

Timing: every provider is captured in a CUDA graph (Python launch overhead excluded for all sides) and
replayed under `triton.testing.do_bench` (L2 flushed before every replay). MoE: our routing (top-k,
sort/pad by expert) is precomputed and shared by ours and BF16 (the BF16 side times
grouped_mm(gate_up) + silu*mul + grouped_mm(down) on expert-sorted rows, no gather/scatter); the anchor
uses its own routing structures from the same logits and does gather, SwiGLU and the scatter-sum inside
its two kernels. Minimal bytes: weights of the experts actually hit read once (FP4: codes + scales),
activations read once, outputs written once. Qwen1.5-MoE's shared expert is not part of the timed layer.
Provider `w4a4-bf16gemm` is what the rollout engine runs above its kernels' crossover (trace/rollout/fast.py):
the same activation codes through the quantize kernel's dequantized copy into BF16 GEMMs on the dequantized
weights (MoE: with the engine's own routing sort inside), so `fp4-w4a4` against it is the crossover.
Rows `fp4-w4a16` / `fp4-w4a4` run the default configs (the engine's choice). Where that is the decode GEMV
(dense up to M=2, MoE up to 1.5 (token, slot) rows per expert), rows `fp4-w4a16-mma` / `fp4-w4a4-mma` time
the MMA tile as well (best of a few tiles, each checked against the oracle first), so one run gives the
GEMV / MMA / BF16 crossover of the engine (trace/rollout/fast.py, benchmarks/crossover.py). Rows `fp4-w4a4-fused` time
the MMA tile with the activation quantize fused into the GEMM / MoE kernels (`fuse_quant`, off by default) beside
`fp4-w4a4`; their check rows also say whether the output is the unfused tile's bit for bit.

Run (repo root, on a GPU): `PYTHONPATH=. python benchmarks/bench_kernels.py --version v1b`
(`--quick` for a subset, `--only moe,dense`, `--families mixtral-8x7b` for the MoE shapes, `--T 1 4 16 64 256` / `--M 1 2 4 8 16` for the sizes, `--sweep` to
also time tile-config variants of ours).
Offline SASS counts (no GPU): `--sass`. Plot: `python -m figures.plot_kernels --out figures/gpu`.
The parts live in benchmarks/kernel_bench/ (harness, quantize, dense, moe, attention, fused: sampling / norm /
routing, sass); this module is the command line and runs them in one process, so one GPU call measures
everything against the same copy-bandwidth ceiling.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch
import triton

from benchmarks.kernel_bench.attention import run_attention
from benchmarks.kernel_bench.dense import MMA_TILES, mma_variants, run_dense, w4a4_bf16_linear  # noqa: F401
from benchmarks.kernel_bench.fused import run_fused, run_sampling
from benchmarks.kernel_bench.harness import (  # noqa: F401
    DENSE_M,
    FAMILIES,
    MOE_T,
    ROWS,
    RUN,
    STATE,
    bench,
    bench_copy,
    check,
    load_anchor,
    log,
    note,
    nv_weight,
    record,
    timed_best,
)
from benchmarks.kernel_bench.moe import route, run_moe, w4a4_bf16_moe  # noqa: F401
from benchmarks.kernel_bench.quantize import run_quantize
from benchmarks.kernel_bench.sass import sass_counts
from benchmarks.results_table import git_commit, today


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/kernels/kernels.csv", help="long table to append to")
    ap.add_argument("--version", default="dev", help="the kernel version under test (a column of every row)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time tile-config variants of ours")
    ap.add_argument("--only", default="quantize,dense,moe,attention,sampling,fused")
    ap.add_argument("--T", type=int, nargs="+", help=f"MoE tokens per layer (default {MOE_T}; --quick: 1 16 256)")
    ap.add_argument("--M", type=int, nargs="+", help=f"dense rows (default {DENSE_M}; --quick: 1 16 64)")
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES),
                    help="MoE shapes to check and time (default: all; --quick: Qwen3 and Mixtral)")
    ap.add_argument("--sass", action="store_true",
                    help="offline: append SASS instruction counts (v1 GEMV, MoE and dense MMA tile, KV decode attention, "
                         "quantize, the v4 Gluon kernels) "
                         "and exit")
    args = ap.parse_args(argv)
    STATE.update(out=args.out, sweep=args.sweep, T=args.T, M=args.M, families=args.families)
    RUN.update(version=args.version, commit=git_commit(), date=today())
    if args.sass:
        return sass_counts()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    dev = torch.device("cuda")
    RUN["gpu"] = torch.cuda.get_device_name(dev)
    torch.manual_seed(int(time.time()))  # fresh random data every run
    log(f"GPU {RUN['gpu']}, torch {torch.__version__}, triton {triton.__version__}, commit {RUN['commit']}")
    log(f"copy bandwidth (read+write) {bench_copy(dev):.0f} GB/s")
    t0 = time.time()
    for part in args.only.split(","):
        try:
            {"quantize": run_quantize, "dense": run_dense, "moe": run_moe, "attention": run_attention,
             "sampling": run_sampling, "fused": run_fused}[part](dev, args.quick)
        except Exception:
            log(f"!! {part} failed:\n{traceback.format_exc()}")
            note(part, f"failed: {traceback.format_exc()[-300:]}")
        log(f"   [{part} done at {time.time() - t0:.0f}s]")
    log("\n== summary (medians; ratio = baseline time / this time)")
    for r in ROWS:
        if r["op"] in ("dense", "moe", "attention", "quantize", "dense-part", "moe-part", "sampling", "norm", "routing"):
            log(f"{r['op']:9s} {r['shape']:30s} {r['provider']:24s} {r['median_us']:9.1f} us {r['pct_copy_bw']!s:>5}% "
                f"x{r['ratio_vs_bf16']!s:>6} bf16 x{r['ratio_vs_anchor']!s:>6} anchor")
    nfail = sum(r.get("ok") is False for r in ROWS)  # notes carry no ok
    log(f"checks: {sum(r.get('ok') is True for r in ROWS)} ok, {nfail} failed; appended {len(ROWS)} rows to {args.out}")


if __name__ == "__main__":
    main()
