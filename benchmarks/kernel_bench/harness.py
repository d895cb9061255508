"""The shared harness of the kernel benchmark: the run's table rows, CUDA-graph timing, checks, the
model-family MoE shapes and the copy-bandwidth ceiling every row's %-of-copy is measured against."""
from __future__ import annotations

import torch
import triton

from benchmarks import anchor_triton_kernels as anchor_mod
from benchmarks.results_table import KERNEL_FIELDS, append
from kernels import reference as ref

FAMILIES = {  # name: (H, I, E, topk); trace/models/registry.py
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "olmoe-1b-7b": (2048, 1024, 64, 8),
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
}
MOE_T = (1, 4, 16, 64, 256)
DENSE_M = (1, 2, 4, 8, 16, 32, 64)
RUN = dict(version="dev", commit="unknown", gpu="cpu", date="")
STATE = dict(out=None, copy_gbps=None, sweep=False, T=None, M=None, families=None)
ROWS: list[dict] = []


def log(*a):
    print(*a, flush=True)


def _emit(row: dict) -> dict:
    row = {**RUN, **row}
    ROWS.append(row)
    if STATE["out"]:
        append(STATE["out"], [row], KERNEL_FIELDS)
    return row


def bench(fn, graph=True):
    """-> (median, p20, p80) ms of fn, captured in a CUDA graph and replayed with an L2 flush."""
    fn()
    torch.cuda.synchronize()
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    q = triton.testing.do_bench(run, warmup=20, rep=100, quantiles=[0.5, 0.2, 0.8])
    return tuple(float(v) for v in q)


def timing_row(op, shape, provider, t, nbytes=None, base_ms=None, anchor_ms=None, config="", note="") -> dict:
    """One measurement as a table row (t = (median, p20, p80) ms; nbytes = minimal bytes moved)."""
    med, p20, p80 = t
    gbps = nbytes / (med * 1e-3) / 1e9 if nbytes else None
    cb = STATE["copy_gbps"]
    return dict(op=op, shape=shape, provider=provider, median_us=round(med * 1e3, 3), p20_us=round(p20 * 1e3, 3),
                p80_us=round(p80 * 1e3, 3), ratio_vs_bf16=round(base_ms / med, 3) if base_ms else "",
                ratio_vs_anchor=round(anchor_ms / med, 3) if anchor_ms else "",
                gb_per_s=round(gbps, 1) if gbps else "", pct_copy_bw=round(100 * gbps / cb, 1) if (gbps and cb) else "",
                ok="", config=config, note=note)


def record(op, shape, provider, t, nbytes=None, base_ms=None, anchor_ms=None, config="", note=""):
    """Time row appended to the table and printed; returns the median in ms."""
    r = _emit(timing_row(op, shape, provider, t, nbytes, base_ms, anchor_ms, config, note))
    log(f"  {op:10s} {shape:30s} {provider:24s} {r['median_us']:9.1f} us {r['pct_copy_bw']!s:>5}%copy "
        f"x{r['ratio_vs_bf16']!s:>6} bf16 x{r['ratio_vs_anchor']!s:>6} anchor {config}")
    return t[0]


def sweep_row(op, shape, provider, t, base_ms, config):
    _emit(timing_row(op + "-sweep", shape, provider, t, base_ms=base_ms, config=config))


def check(name, ok, detail):
    _emit(dict(op="check", shape=name, ok=bool(ok), note=detail))
    log(f"  CHECK {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    return bool(ok)


def note(op, detail):
    """A run-level remark in the table (e.g. a provider that was skipped, and why)."""
    _emit(dict(op=op, shape="", provider="note", note=detail))


def relerr(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def nv_weight(shape, dev, outer="tensor"):
    w = torch.randn(*shape, device=dev) * 0.02
    return ref.nvfp4_quantize(w, outer=outer)


def load_anchor():
    """The triton_kernels provider module, or None (the reason is printed once and noted in the table)."""
    if anchor_mod.load() is None:
        note("anchor", anchor_mod.skip_reason())
        return None
    return anchor_mod


def cfg_str(c):
    return ";".join(f"{k}={v}" for k, v in c.__dict__.items())


def timed_best(fn_of_cfg, variants, op, shape, provider, base_ms, oracle=None):
    """Time fn_of_cfg(cfg) for each variant (a sweep row each); -> (best t, best cfg) or (None, None).
    oracle: (reference output, tolerance): each variant's output is checked against it first (a check row);
    a variant that fails is not timed."""
    best = (None, None)
    for cfg in variants:
        try:
            fn = fn_of_cfg(cfg)
            if oracle is not None:
                e = relerr(fn(), oracle[0])
                if not check(f"{op} {shape} {provider} {cfg_str(cfg)}", e < oracle[1],
                             f"rel err {e:.2e} (tol {oracle[1]:g})"):
                    continue
            t = bench(fn)
        except Exception as ex:  # a config that fails to compile is skipped, not fatal
            log(f"  variant {cfg} failed: {type(ex).__name__}: {str(ex)[:200]}")
            continue
        if len(variants) > 1:
            sweep_row(op, shape, provider, t, base_ms, cfg_str(cfg))
        if best[0] is None or t[0] < best[0][0]:
            best = (t, cfg)
    return best


# ------------------------------------------------------------------------------------------------
def bench_copy(dev):
    n = 1 << 29  # 1 GiB of bytes (bf16 512M elements)
    a = torch.empty(n // 2, dtype=torch.bfloat16, device=dev).normal_()
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a), graph=False)
    STATE["copy_gbps"] = 2 * n / (t[0] * 1e-3) / 1e9
    record("memcpy", "1GiB d2d", "torch-copy", t, 2 * n)
    return STATE["copy_gbps"]
