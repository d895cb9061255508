"""CUDA graphs of the rollout engine's one-token decode steps.

What: `DecodeGraphs(forward, cache)` replays a captured `EngineForward` call for ALL B cache rows and one
new token each (rows that have nothing to feed pass `lens = 0`: their token goes to the cache's trash
slot and their logits are ignored), so a decode step costs one graph launch instead of a few hundred
kernel launches from Python. One graph per attention length bucket (`bucket` slots, default 256): a
step attends over `S = round_up(max position + 1, bucket)` slots (positions past a row's own are masked),
so the graph of a bucket serves every step whose longest row fits, and the work grows with the context
the way an eager step's does, not with the cache capacity. Graphs are captured lazily, the first time a
bucket is reached, after one eager warm-up call of the same step (which writes the same K/V the replay
writes again, so it changes nothing), or all at once by `capture_all()` (RolloutEngine.prepare); all
graphs share one memory pool. The graphs read the weights and the cache by address: the engine keeps
one (cache, graphs) pair per (batch, capacity) across generate calls and drops it at every
sync_weights, which allocates new weight tensors.

Why this is allowed: the forward has no host synchronisation on CUDA (grouped GEMM offsets by
scatter_add, FP4 quantization without finiteness checks, the Triton kernels with check_finite=False),
and every shape in it depends only on (B, S).

The logits tensor returned is the graph's static output: it is overwritten by the next replay, so it
must be consumed (sampled) before the next call, which is what RolloutEngine.generate does.

Compared against: the eager forward of the same steps (tests/rollout/test_gpu.py on a GPU; the engine
falls back to eager on a CPU, with a recorder, or when `cuda_graphs=False`).
"""
from __future__ import annotations

import torch


class DecodeGraphs:
    def __init__(self, forward, cache, bucket: int = 256):
        self.fwd, self.cache, self.bucket = forward, cache, bucket
        B, dev = cache.batch, forward.w.embed.device
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.start = torch.zeros(B, dtype=torch.long, device=dev)
        self.lens = torch.zeros(B, dtype=torch.long, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def span(self, max_len: int) -> int:
        """Attention length of the bucket that holds positions < max_len (at most the cache capacity)."""
        return min(-(-max_len // self.bucket) * self.bucket, self.cache.cap)

    def _run(self, S: int) -> torch.Tensor:
        return self.fwd(self.ids, self.start, self.lens, None, self.cache, None, False, S)

    def _capture(self, S: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(S)  # warm-up: Triton compiles, cuBLAS picks its kernels, allocator settles
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self._run(S)
        self.graphs[S] = (g, out)

    def capture_all(self) -> None:
        """Capture every bucket up to the cache capacity now (as an engine does at start-up), with every
        row idle (lens 0: all writes go to the trash slot, so the cache's contents are untouched)."""
        self.ids.zero_()
        self.start.zero_()
        self.lens.zero_()
        for S in sorted({self.span(n) for n in range(1, self.cache.cap + 1, self.bucket)} | {self.cache.cap}):
            if S not in self.graphs:
                self._capture(S)
        torch.cuda.synchronize()

    def __call__(self, ids: torch.Tensor, start: torch.Tensor, lens: torch.Tensor, max_len: int) -> torch.Tensor:
        """ids [B, 1], start [B], lens [B] (0 or 1) on the device -> logits [B, V] (static buffer)."""
        self.ids.copy_(ids, non_blocking=True)
        self.start.copy_(start, non_blocking=True)
        self.lens.copy_(lens, non_blocking=True)
        S = self.span(max_len)
        if S not in self.graphs:
            self._capture(S)
        g, out = self.graphs[S]
        g.replay()
        return out
