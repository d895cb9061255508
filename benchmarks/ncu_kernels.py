"""Hardware counters of the FP4 kernels that miss their targets, beside their BF16 and `triton_kernels` counterparts:
one launch of each under Nsight Compute, then one table of where each kernel's time goes.

What: `run` builds each target's inputs at the shape its target is stated at (issue 14: the activation quantize
8192x4096, dense decode 14336x4096 at M 16, the Qwen3-30B-A3B MoE layer at T 256, FP4-KV decode attention 64 x 8k),
launches it a few times outside the profiled range (Triton compiles, caches settle), then once between
cudaProfilerStart / Stop, so `ncu --profile-from-start off` sees exactly one launch per kernel of each target;
`summarize` turns ncu's CSV into a markdown table per kernel: duration, DRAM bytes and throughput (% of peak),
SM and issue-slot busy, achieved / theoretical occupancy, registers, and the top warp stall reasons (cycles per
issued instruction), i.e. whether a kernel waits on memory, on latency with too few warps, or on issue.

Run on the H200 (Firecracker machines read the counters; `--clock-control none` leaves the clocks alone, as the
device notes ask):

    PYTHONPATH=$PWD:.anchors/triton_kernels-v3.6.0 ncu --profile-from-start off --clock-control none --csv \
        --page details --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis --metrics "$(python3 benchmarks/ncu_kernels.py metrics)" \
        python3 benchmarks/ncu_kernels.py run > ncu.csv
    python3 benchmarks/ncu_kernels.py summarize ncu.csv > ncu.md

`run --targets dense-triton moe-triton ...` narrows it (`run --list` names them). Compared against: the same
kernels' timings in benchmarks/bench_kernels.py (results/kernels/kernels.csv); kernels/NOTES.md keeps the readings.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import gzip
import io
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

HQ, HKV, HD = 32, 4, 128  # the attention benchmark's heads (bench_kernels.run_attention)


def _quantize(dev):
    from kernels.quantize import quantize_rows

    x = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    return {"quantize-nvfp4": lambda: quantize_rows(x, "nvfp4", check_finite=False),
            # an elementwise kernel that reads and writes x once: a clone is a cudaMemcpy, which ncu does not profile
            "copy-bf16": lambda: x.mul(1)}


def _dense(dev):
    from benchmarks.bench_kernels import nv_weight
    from kernels.gemm import default_config, fp4_linear, prepare_weight

    M, N, K = 16, 14336, 4096
    c, s, o = nv_weight((N, K), dev)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    wb = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    pw = prepare_weight(c, s, o)
    out = {"dense-cublas": lambda: F.linear(x, wb),
           "dense-triton": lambda: fp4_linear(x, pw, check_finite=False),
           "dense-triton-w4a4": lambda: fp4_linear(x, pw, act_quant=True, check_finite=False)}
    d = default_config(M, N, K, dev)  # what "dense-triton" runs
    tma = dataclasses.replace(d, tma=True, BKW=32)  # v5a: words and scales by TMA
    out["dense-triton-tma"] = lambda: fp4_linear(x, pw, config=tma, check_finite=False)
    # 128 weight rows per program: each activation K-slice is read by half as many programs (at M 16 and BN 64,
    # N/BN x 16 x K x 2 = 29 MB of activation reads, as much as the weights' 33 MB; the L2 -> L1 bytes measured fell
    # 16%, kernels/NOTES.md v5a)
    bn128 = dataclasses.replace(d, BN=128, num_warps=8)  # as the sweep's MMA_TILES
    out["dense-triton-bn128"] = lambda: fp4_linear(x, pw, config=bn128, check_finite=False)
    r64 = dataclasses.replace(d, maxnreg=64)  # v5b: 64 registers, 8 programs per SM instead of 5 (no spills offline)
    out["dense-triton-r64"] = lambda: fp4_linear(x, pw, config=r64, check_finite=False)
    return out


def _moe(dev):
    from benchmarks import anchor_triton_kernels as anchor_mod
    from benchmarks.bench_kernels import FAMILIES, nv_weight, route
    from kernels import reference as ref
    from kernels.moe import default_moe_config, fused_moe, moe_align, prepare_moe_weights

    H, I, E, k = FAMILIES["qwen3-30b-a3b"]
    T = 256
    g, u, d = (nv_weight(sh, dev, "expert") for sh in ((E, I, H), (E, I, H), (E, H, I)))
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    ids, tw = route(T, E, k, dev)
    mw = prepare_moe_weights(g, u, d)
    cfg = default_moe_config(T, k, E)
    al = moe_align(ids, E, cfg.BM)
    w13 = torch.cat([ref.nvfp4_dequantize(*g), ref.nvfp4_dequantize(*u)], 1).to(torch.bfloat16)  # [E, 2I, H]
    w2 = ref.nvfp4_dequantize(*d).to(torch.bfloat16)  # [E, H, I]
    flat = ids.reshape(-1).long()
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    xs = x[torch.argsort(flat, stable=True) // k].contiguous()
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)

    def bf16_moe():
        h = torch._grouped_mm(xs, w13t, offs=offs)
        return torch._grouped_mm(F.silu(h[:, :I]) * h[:, I:], w2t, offs=offs)

    out = {"moe-grouped_mm": bf16_moe,
           "moe-triton": lambda: fused_moe(x, mw, ids, tw, config=cfg, align=al, check_finite=False)}
    tma = dataclasses.replace(cfg, tma=True, BKW=32)  # v5a: the weight tiles by TMA
    out["moe-triton-tma"] = lambda: fused_moe(x, mw, ids, tw, config=tma, align=al, check_finite=False)
    # 128 weight rows per program (gate and up each): the expert's activation block is read by half as many
    # programs (at T 256 and BN 64 the activation bytes through L1/TEX are ~0.9x the gate/up weights' and ~1.7x the
    # down weights': 248 blocks x 12 or 32 row tiles x the block's rows)
    bn128 = dataclasses.replace(cfg, BN=128, BN_down=128, num_warps=8)
    out["moe-triton-bn128"] = lambda: fused_moe(x, mw, ids, tw, config=bn128, align=al, check_finite=False)
    r80 = dataclasses.replace(cfg, maxnreg=80, maxnreg_down=80)  # v5b: 6 programs per SM instead of 3 (gate/up), 5 (down)
    out["moe-triton-r80"] = lambda: fused_moe(x, mw, ids, tw, config=r80, align=al, check_finite=False)
    if anchor_mod.load() is not None:
        anc = anchor_mod.MoELayer(w13t.contiguous(), w2t.contiguous(), k)
        st, _, _ = anc.route(torch.randn(T, E, device=dev, dtype=torch.float16))
        anc.deq1 = anc.deq2 = None
        out["moe-triton_kernels"] = lambda: anc(x, st)
    else:
        print(f"moe-triton_kernels skipped: {anchor_mod.skip_reason()}", file=sys.stderr)
    return out


def _attention(dev):
    from kernels.attention import FP4KVCache, decode_attention, kv_store
    from kernels.attention_mma import decode_attention_mma

    B, L = 64, 8192
    kb = torch.randn(B, HKV, L, HD, device=dev, dtype=torch.bfloat16)
    vb = torch.randn(B, HKV, L, HD, device=dev, dtype=torch.bfloat16)
    q = torch.randn(B, HQ, HD, device=dev, dtype=torch.bfloat16)
    cache = FP4KVCache.allocate(B * L, HKV, HD, dev)
    kv_store(cache, kb.transpose(1, 2).reshape(B * L, HKV, HD), vb.transpose(1, 2).reshape(B * L, HKV, HD),
             torch.arange(B * L, device=dev))
    starts = torch.arange(B, device=dev) * L
    lens = torch.full((B,), L, device=dev)
    q4 = q.unsqueeze(2)
    return {"attention-sdpa": lambda: F.scaled_dot_product_attention(q4, kb, vb, enable_gqa=True),
            "attention-fp4kv": lambda: decode_attention(q, cache, starts, lens, L, check_finite=False),
            "attention-mma": lambda: decode_attention_mma(q, cache, starts, lens, L, check_finite=False)}


def _attention_engine(dev):
    """The engine's decode attention per layer at batch 256 and the 1k-generation run's mean context (1024): the
    default tile, and under register caps that fit 4 (128) or 5 (96, 32-token tiles) programs per SM, not 3; the
    register-operand kernel (the engine's default) at its default splits."""
    from kernels.attention import FP4KVCache, decode_attention, kv_store
    from kernels.attention_mma import decode_attention_mma

    B, L = 256, 1024
    cache = FP4KVCache.allocate(B * L, HKV, HD, dev)
    kv = torch.randn(B * L, HKV, HD, device=dev, dtype=torch.bfloat16)
    kv_store(cache, kv, kv.flip(0), torch.arange(B * L, device=dev))
    q = torch.randn(B, HQ, HD, device=dev, dtype=torch.bfloat16)
    starts = torch.arange(B, device=dev) * L
    lens = torch.full((B,), L, device=dev)
    run = lambda **kw: (lambda: decode_attention(q, cache, starts, lens, L, check_finite=False, **kw))  # noqa: E731
    return {"attention-fp4kv-b256": run(), "attention-fp4kv-b256-r128": run(maxnreg=128),
            "attention-fp4kv-b256-bn32-r96": run(block_n=32, maxnreg=96),
            "attention-mma-b256": lambda: decode_attention_mma(q, cache, starts, lens, L, check_finite=False)}


# each builder's targets (a builder makes the inputs its targets share)
GROUPS = {_quantize: ("quantize-nvfp4", "copy-bf16"),
          _dense: ("dense-cublas", "dense-triton", "dense-triton-w4a4", "dense-triton-tma", "dense-triton-bn128",
                   "dense-triton-r64"),
          _moe: ("moe-grouped_mm", "moe-triton", "moe-triton_kernels", "moe-triton-tma", "moe-triton-bn128",
                 "moe-triton-r80"),
          _attention: ("attention-sdpa", "attention-fp4kv", "attention-mma"),
          _attention_engine: ("attention-fp4kv-b256", "attention-fp4kv-b256-r128", "attention-fp4kv-b256-bn32-r96",
                              "attention-mma-b256")}
# per-reason warp stalls (cycles per issued instruction); ncu's WarpStateStats section charts them without listing
# them in its CSV, so the command asks for them by name (`--metrics`, see `ncu_metrics`)
STALLS = ("long_scoreboard", "short_scoreboard", "wait", "barrier", "mio_throttle", "lg_throttle", "math_pipe_throttle",
          "not_selected", "selected", "dispatch_stall", "no_instruction", "membar", "branch_resolving", "drain", "sleeping",
          "tex_throttle", "imc_miss", "misc")
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


# counts asked for by name too, per launch: the warp instructions executed (against the offline SASS counts), the
# bytes read from DRAM, and the bytes L1 read from L2 (32-byte sectors), where the activation tile's re-reads by every
# weight-row program land (kernels/NOTES.md, "Where the time goes") -> (column, factor to the column's unit, the
# metric's base unit)
COUNTS = {"smsp__inst_executed.sum": ("warp inst (M)", 1e-6, "inst"),
          "dram__bytes_read.sum": ("DRAM read MB", 1e-6, "byte"),
          "lts__t_sectors_srcunit_tex_op_read.sum": ("L2->L1 MB", 32e-6, "sector"),
          # shared-memory wavefronts (one per 128 bytes a warp moves through the shared pipe, more when its lanes
          # conflict on banks) and the bank conflicts among them: the decoded tile's round trip (kernels/NOTES.md)
          "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": ("shared wavefronts (M)", 1e-6, ""),
          "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": ("shared bank conflicts (M)", 1e-6, "")}
_SI = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def ncu_metrics(counts: bool = True) -> str:
    """The `--metrics` argument of the ncu command line (the stall reasons, and COUNTS unless counts=False: ncu
    refuses a whole run over one metric name it does not know; all five were read on the H200's ncu)."""
    return ",".join([STALL_METRIC.format(r) for r in STALLS] + (list(COUNTS) if counts else []))


# A marker's grid names its target by the index here: append only (committed CSVs, results/kernels/ncu/, were
# summarized by these indices; dense-v4b / moe-v4b name the Gluon wgmma kernels deleted in v5k).
TARGETS = ("quantize-nvfp4", "copy-bf16", "dense-cublas", "dense-triton", "dense-triton-w4a4", "dense-v4b",
           "moe-grouped_mm", "moe-triton", "moe-v4b", "moe-triton_kernels", "attention-sdpa", "attention-fp4kv",
           "dense-triton-tma", "moe-triton-tma", "dense-triton-bn128", "moe-triton-bn128", "dense-triton-r64",
           "moe-triton-r80", "attention-fp4kv-b256", "attention-fp4kv-b256-r128", "attention-fp4kv-b256-bn32-r96",
           "attention-mma", "attention-mma-b256")
MARKER = "_ncu_target_marker"


@triton.jit
def _ncu_target_marker(x_ptr):
    """Launched with grid (index of the target in TARGETS + 1,) just before a target's kernels inside the profiled
    range, so `summarize` can tell whose kernels follow (ncu's CSV has no trace of the range they ran in)."""
    tl.store(x_ptr + tl.program_id(0), 0)


def run(targets: list[str] | None, warmup: int = 3) -> list[str]:
    """Each target's kernels: `warmup` launches, then one inside cudaProfilerStart/Stop. Returns the names run."""
    unknown = set(targets or ()) - {n for names in GROUPS.values() for n in names}
    if unknown:
        raise ValueError(f"unknown targets {sorted(unknown)}; `run --list` names them")
    dev = torch.device("cuda")
    scratch = torch.empty(len(TARGETS), dtype=torch.int32, device=dev)
    done = []
    for group, names in GROUPS.items():
        if targets and not set(names) & set(targets):
            continue
        for name, fn in group(dev).items():
            if targets and name not in targets:
                continue
            for _ in range(warmup):
                fn()
            _ncu_target_marker[(TARGETS.index(name) + 1,)](scratch)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(name)
            torch.cuda.profiler.start()
            _ncu_target_marker[(TARGETS.index(name) + 1,)](scratch)
            fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            torch.cuda.nvtx.range_pop()
            print(f"profiled {name}", file=sys.stderr)
            done.append(name)
    return done


# (ncu section, metric) -> column; sections SpeedOfLight, MemoryWorkloadAnalysis, SchedulerStats, Occupancy,
# LaunchStats. Keyed by section too: "Memory Throughput" is a % of peak under Speed Of Light and bytes/s under
# Memory Workload Analysis.
COLUMNS = {
    ("GPU Speed Of Light Throughput", "Duration"): "us",
    ("GPU Speed Of Light Throughput", "DRAM Throughput"): "DRAM %",
    ("Memory Workload Analysis", "Memory Throughput"): "DRAM GB/s",
    ("GPU Speed Of Light Throughput", "Memory Throughput"): "mem %",
    ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"): "SM %",
    ("Scheduler Statistics", "Issued Warp Per Scheduler"): "issued/cycle",
    ("Occupancy", "Achieved Occupancy"): "occ %",
    ("Occupancy", "Theoretical Occupancy"): "theor occ %",
    ("Launch Statistics", "Registers Per Thread"): "regs",
    ("Scheduler Statistics", "Eligible Warps Per Scheduler"): "eligible warps/sched",
}
_TIME = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "ns": 1e-3, "us": 1.0, "ms": 1e3}  # -> us (ncu picks per kernel)
_RATE = {"byte/s": 1e-9, "Kbyte/s": 1e-6, "Mbyte/s": 1e-3, "Gbyte/s": 1.0, "Tbyte/s": 1e3}  # -> GB/s


def summarize(text: str, top: int = 3) -> str:
    """ncu `--csv --page details` output -> one markdown row per profiled kernel launch (in launch order), each
    under the target whose marker launch precedes it, then each target's kernel time summed."""
    start = text.find('"ID"')
    if start < 0:
        raise ValueError("no ncu CSV header (\"ID\",...) in the input: was ncu run with --csv --page details?")
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    kernels: dict[str, dict] = {}
    stalls: dict[str, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["Kernel Name"] is None:  # one of ncu's ==WARNING== lines between the rows
            continue
        kid = r["ID"]
        k = kernels.setdefault(kid, {"kernel": r["Kernel Name"][:60], "grid": r.get("Grid Size", ""),
                                     "block": r.get("Block Size", "")})
        if MARKER in r["Kernel Name"]:
            k["marks"] = TARGETS[int(k["grid"].strip("()").split(",")[0]) - 1]
        metric, unit, value = r["Metric Name"], r.get("Metric Unit", ""), r["Metric Value"].replace(",", "")
        col = COLUMNS.get((r.get("Section Name", ""), metric))
        if col is not None:
            scale = _TIME.get(unit) if col == "us" else _RATE.get(unit) if col == "DRAM GB/s" else None
            k[col] = f"{float(value) * scale:.1f}" if scale else value
        elif metric in COUNTS:
            name, factor, base = COUNTS[metric]
            prefix = unit[: -len(base)] if unit.endswith(base) else None
            k[name] = f"{float(value) * _SI[prefix] * factor:.1f}" if prefix in _SI else f"{value} {unit}"
        elif metric.startswith("smsp__average_warps_issue_stalled_"):
            try:
                stalls[kid][metric[len("smsp__average_warps_issue_stalled_"):].split("_per_issue")[0]] = float(value)
            except ValueError:
                pass
    cols = ["target", "kernel", "grid", "block", *COLUMNS.values(), *(c[0] for c in COUNTS.values()),
            "top stalls (cycles per issued instruction)"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    target, totals = "", defaultdict(lambda: [0, 0.0])
    for kid, k in kernels.items():
        if "marks" in k:
            target = k["marks"]
            continue
        worst = sorted(stalls[kid].items(), key=lambda kv: -kv[1])[:top]
        k[cols[-1]] = ", ".join(f"{n} {v:.1f}" for n, v in worst)
        k["target"] = target
        out.append("| " + " | ".join(str(k.get(c, "")) for c in cols) + " |")
        totals[target][0] += 1
        totals[target][1] += float(k.get("us") or 0)
    if any(totals):
        out += ["", "| target | kernels | kernel time (us, summed) |", "|---|---|---|"]
        out += [f"| {t} | {n} | {us:.1f} |" for t, (n, us) in totals.items() if t]
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="launch the targets once each inside the profiled range (under ncu)")
    r.add_argument("--targets", nargs="*", help="names (default: all)")
    r.add_argument("--list", action="store_true", help="print the target names and exit")
    s = sub.add_parser("summarize", help="ncu CSV -> markdown table")
    s.add_argument("csv", help="ncu's CSV (or .csv.gz)")
    m = sub.add_parser("metrics", help="print the --metrics argument for ncu")
    m.add_argument("--no-counts", action="store_true", help="the stall reasons only")
    a = ap.parse_args(argv)
    if a.cmd == "summarize":
        with (gzip.open if a.csv.endswith(".gz") else open)(a.csv, "rt") as f:
            print(summarize(f.read()), end="")
    elif a.cmd == "metrics":
        print(ncu_metrics(not a.no_counts))
    elif a.list:
        print(" ".join(n for n in TARGETS if any(n in names for names in GROUPS.values())))
    else:
        run(a.targets)


if __name__ == "__main__":
    main()
