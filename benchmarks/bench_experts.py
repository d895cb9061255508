"""The QAT model's forward+backward with the experts' loop and with the grouped path (trace/qat/experts.py), one
model, one batch, under BF16 autocast: the median wall time per path and their ratio.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_experts.py --model qwen3_moe-small --mode w4a4kv4 --batch 4 --seq 128
    PYTHONPATH=. .venv/bin/python benchmarks/bench_experts.py --model qwen3_moe-tiny --batch 8 --seq 64 --threads 1

Each repetition runs both paths in turn on the same weights (alternating, so drift hits both alike); the first
`--warmup` repetitions are not counted. Prints one line per path and the ratio loop / grouped.
Compared against: the loop path itself (tests/qat/test_experts.py checks that the two compute the same).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from trace.models import build_model
from trace.qat import patch_model


def _step(model, ids, dev) -> None:
    with torch.autocast(dev, dtype=torch.bfloat16):
        loss = model(ids).logits.float().pow(2).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    if dev == "cuda":
        torch.cuda.synchronize()


def bench(model_name: str, mode: str, batch: int, seq: int, reps: int, warmup: int) -> dict[str, float]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(model_name, seed=0, device=dev)
    rt = patch_model(model, mode)
    ids = torch.randint(5, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(dev)
    times: dict[str, list[float]] = {"loop": [], "grouped": []}
    for i in range(warmup + reps):
        for path in times:
            rt.experts = path
            t0 = time.perf_counter()
            _step(model, ids, dev)
            if i >= warmup:
                times[path].append(time.perf_counter() - t0)
    return {p: statistics.median(t) for p, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3_moe-tiny")
    ap.add_argument("--mode", default="w4a4kv4", help="trace.qat.patch_model mode")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default); 1 on a shared CPU")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    med = bench(a.model, a.mode, a.batch, a.seq, a.reps, a.warmup)
    for p, s in med.items():
        print(f"{a.model} {a.mode} {a.batch}x{a.seq} {p:8s} fwd+bwd {s * 1e3:8.1f} ms")
    print(f"loop / grouped: {med['loop'] / med['grouped']:.2f}x")


if __name__ == "__main__":
    main()
