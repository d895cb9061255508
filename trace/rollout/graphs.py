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
one (cache, graphs) pair per (batch, capacity) across generate calls and weight syncs (`sync_weights`
copies the new weights into the tensors the graphs read, `trace.rollout.weights.copy_into`).

Why this is allowed: the forward has no host synchronisation on CUDA (grouped GEMM offsets by
scatter_add, FP4 quantization without finiteness checks, the Triton kernels with check_finite=False),
and every shape in it depends only on (B, S).

The logits tensor returned is the graph's static output: it is overwritten by the next replay, so it
must be consumed (sampled) before the next call, which is what RolloutEngine.generate does.

Recording: with a `StepRecording`, the captured step also writes every recorded site's rows (all B rows,
record form) into device buffers at the step index, which `flush` hands to the recorder after the call. The
sites quantized by the Triton kernels (the projections' and experts' inputs, K/V) are written by the quantize
launch that computes their codes (`StepRecording.sink`: no extra kernels); the expert ids, and the sites of a
path without those kernels, by a few torch ops each (`add_routing`, `add`).

Compared against: the eager forward of the same steps (tests/rollout/test_gpu.py on a GPU, records bit for
bit at one graph per attention length; tests/rollout/test_graph_record.py runs the uncaptured all-row
steps on the CPU). The engine runs eager steps instead on a CPU, for multi-token chunks (a multi-turn
call's observations), or when `cuda_graphs=False`.
"""
from __future__ import annotations

import math

import torch

from trace.fp4 import MXFP4_BLOCK, NVFP4_BLOCK
from trace.fp4 import reference as ref


def record_spec(recorder, num_layers: int) -> tuple:
    """What a recorder (or a record.Tee of several) keeps of a forward: (layers whose sites it stores,
    layers whose expert ids it stores, whether it needs full codes). Graphs recorded for one spec serve
    every later recorder of the same spec."""
    recs = getattr(recorder, "recorders", [recorder])
    sites = frozenset(i for i in range(num_layers) if any(r.wants(i) for r in recs))
    routing = frozenset(i for i in range(num_layers) if any(r.keeps_routing(i) for r in recs))
    return sites, routing, any(r.full_codes for r in recs)


class StepRecording:
    """The recording side of the one-token decode steps: each site's rows of ALL B cache rows go to device
    buffers [max_steps, B, ...] at the step index (`step`, a device tensor set before each step) in record
    form (mantissa bits packed, scale bytes, outer scales, packed codes if a recorder wants them, expert
    ids), with no host work, so a step records inside its CUDA graph. `flush` then hands the rows that were
    real (the fed rows of each step, at their positions) to the recorder through `add_rows` /
    `add_routing`, one call per (layer, site) for up to max_steps steps (the engine flushes when the window
    is full and after the call, and starts the next window at step 0). Buffers are allocated by the first
    (eager warm-up) step."""

    # sites on the quantize kernels record through `sink` (the launch writes the record); False: through `add`
    in_kernel = True

    def __init__(self, spec: tuple, batch: int, max_steps: int, device):
        self.sites, self.routing_layers, self.full_codes = spec
        self.batch, self.max_steps = batch, max_steps
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.bufs: dict[tuple[int, str], tuple[list[torch.Tensor], str]] = {}
        self.route: dict[int, torch.Tensor] = {}
        self.sinks: dict[tuple[int, str], object] = {}
        self.views: dict[tuple[int, str], tuple] = {}  # a sink's buffers as the quantize launch writes them

    def wants(self, layer: int) -> bool:
        return layer in self.sites

    def sink(self, layer: int, site: str, inner: tuple = ()):
        """The record sink of (layer, site) (`trace.fp4.rows.record_sink`), for a quantize launch of all B rows
        of a step, rows [B, *inner] flattened (inner: (k,) for the experts' down input, (H_kv,) for K/V): the
        launch writes the site's record form (the parts `add` writes, in the same buffers and layout) at row
        `step` itself. None when the layer is not recorded, or with `in_kernel` off."""
        if layer not in self.sites or not self.in_kernel:
            return None
        key = (layer, site)
        if key not in self.sinks:
            from trace.fp4.rows import record_sink

            self.sinks[key] = record_sink(lambda M, K, fmt: self._targets(key, tuple(inner), M, K, fmt))
        return self.sinks[key]

    def _targets(self, key, inner: tuple, M: int, K: int, fmt: str) -> tuple:
        """(mantissa, scales, outer, codes or None, step) of site `key` as [max_steps, M, ...] views of its buffers
        [max_steps, B, *inner, ...] (allocated here on the first step, as `add` allocates them)."""
        lead = (self.batch, *inner)
        if M != math.prod(lead):
            raise ValueError(f"a recorded step quantizes {M} rows at {key}, its buffers hold {lead}")
        if key in self.views:  # made once: a step then runs no torch op for the record of this site
            return self.views[key]
        if key not in self.bufs:
            block = NVFP4_BLOCK if fmt == "nvfp4" else MXFP4_BLOCK
            dev = self.step.device

            def zeros(width: int, dtype: torch.dtype) -> torch.Tensor:
                return torch.zeros(self.max_steps, *lead, width, dtype=dtype, device=dev)

            parts = [zeros(K // 8, torch.uint8), zeros(K // block, torch.uint8), zeros(1, torch.float32)]
            if self.full_codes:
                parts.append(zeros(K // 2, torch.uint8))
            self.bufs[key] = (parts, fmt)
        parts, _ = self.bufs[key]
        mant, scales, outer, *codes = (p.view(self.max_steps, M, -1) for p in parts)
        self.views[key] = (mant, scales, outer.view(self.max_steps, M), codes[0] if codes else None, self.step)
        return self.views[key]

    def _put(self, buf: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        if buf is None:
            buf = torch.zeros(self.max_steps, *x.shape, dtype=x.dtype, device=x.device)
        buf.index_copy_(0, self.step, x.unsqueeze(0))  # row `step` of [max_steps, B, ...]
        return buf

    def add(self, layer: int, site: str, t) -> None:
        """t: an FP4Tensor of all B rows, codes [B, *inner, K]: its record form by torch ops (a site not on the
        quantize kernels; theirs come through `sink`)."""
        if layer not in self.sites:
            return
        parts = [ref.pack_bits(t.codes & 1), t.scales, t.outer.float().expand(*t.codes.shape[:-1], 1)]
        if self.full_codes:
            parts.append(ref.pack_fp4(t.codes))
        old = self.bufs.get((layer, site), ([None] * len(parts), t.fmt))[0]
        self.bufs[(layer, site)] = ([self._put(b, p) for b, p in zip(old, parts, strict=True)], t.fmt)

    def add_routing(self, layer: int, expert_ids: torch.Tensor) -> None:
        """expert_ids [B, k] of all B rows."""
        if layer in self.routing_layers:
            self.route[layer] = self._put(self.route.get(layer), expert_ids)

    def flush(self, recorder, steps: list[dict[int, int]]) -> None:
        """steps[t]: {cache row b: position} of the rows fed at step t (sample b = record sequence b)."""
        if len(steps) > self.max_steps:
            raise ValueError(f"{len(steps)} steps recorded into buffers of {self.max_steps}")
        flat = [t * self.batch + b for t, fed in enumerate(steps) for b in fed]
        if not flat:
            return
        dev = self.step.device  # the record's keys are made where its rows are (no host copies)
        seq = torch.tensor([b for fed in steps for b in fed], device=dev)
        pos = torch.tensor([p for fed in steps for p in fed.values()], device=dev)
        idx = torch.tensor(flat, device=dev)
        rows = lambda buf: buf.flatten(0, 1).index_select(0, idx)  # noqa: E731  [n, ...] of [max_steps*B, ...]
        for (layer, site), (parts, fmt) in self.bufs.items():
            mant, scales, outer, *codes = (rows(p) for p in parts)
            recorder.add_rows(layer, site, mant, scales, outer, codes[0] if codes else None, fmt, seq, pos)
        for layer, buf in self.route.items():
            recorder.add_routing(layer, rows(buf), seq, pos)


class DecodeGraphs:
    def __init__(self, forward, cache, bucket: int = 256, recording: StepRecording | None = None):
        self.fwd, self.cache, self.bucket, self.recording = forward, cache, bucket, recording
        B, dev = cache.batch, forward.w.embed.device
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.start = torch.zeros(B, dtype=torch.long, device=dev)
        self.lens = torch.zeros(B, dtype=torch.long, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # off a GPU the same all-row steps run eagerly (what the CPU tests of recorded steps use)
        self.capture = dev.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def span(self, max_len: int) -> int:
        """Attention length of the bucket that holds positions < max_len (at most the cache capacity)."""
        return min(-(-max_len // self.bucket) * self.bucket, self.cache.cap)

    def _run(self, S: int) -> torch.Tensor:
        return self.fwd(self.ids, self.start, self.lens, None, self.cache, self.recording, False, S)

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

    def __call__(self, ids: torch.Tensor, start: torch.Tensor, lens: torch.Tensor, max_len: int,
                 step: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, 1], start [B], lens [B] (0 or 1) on the device -> logits [B, V] (static buffer).
        step [1]: the decode step's index into the recording's buffers (with a recording)."""
        self.ids.copy_(ids, non_blocking=True)
        self.start.copy_(start, non_blocking=True)
        self.lens.copy_(lens, non_blocking=True)
        if self.recording is not None:
            self.recording.step.copy_(step, non_blocking=True)
        S = self.span(max_len)
        if not self.capture:
            return self._run(S)
        if S not in self.graphs:
            self._capture(S)
        g, out = self.graphs[S]
        g.replay()
        return out
