"""The embedded FP4 rollout engine: batched prefill + decode with a KV cache, sampling, multi-turn, recording.

What: `RolloutEngine(config, mode="bf16"|"w4a4", fmt, kv_fp4, dtype, device, max_seq_len)` loads a
policy's weights by their HF names (`sync_weights(model_or_state_dict)`, re-quantizing FP4 weights with
`trace.fp4.quantize_weight` at every sync) and generates with its own forward (trace/rollout/forward.py):

    eng = RolloutEngine(model.config, mode="w4a4", kv_fp4=True); eng.sync_weights(model)
    out = eng.generate([[1, 40, 41]], n=4, max_new_tokens=32, temperature=1.0, seed=0,
                       stop_token_ids=(EOS_ID,), recorder=Recorder())
    out.tokens[i], out.logprobs[i], out.trainable[i]     # sample i = prompt out.prompt_index[i]

How: the unique prompts are prefilled ONCE (mixed lengths in one ragged chunk, each row at its own
positions, no left padding) into the cache row of their first sample; the row is copied to the other
n-1 samples (their prompt records are aliases: `recorder.alias(seq, first_seq, prompt_len)`). Decode
then feeds every unfinished sample one token per step; a sample whose turn ended at a stop string
gets the environment's observation appended (trainable False, log-prob 0.0) and fed as one chunk,
reusing the cache. Sampling: temperature (0 = greedy), nucleus top_p, one seeded `torch.Generator`
per call (same seed and batch -> same outputs). `logprobs` are the log-probs of the sampled tokens
under the sampling distribution, log_softmax(logits / temperature) of the engine's own logits (the
behaviour policy, which the RL trainer compares its own log-probs at the same temperature with);
greedy decoding (temperature 0) reports them at temperature 1, and top_p < 1 truncates sampling but
not these log-probs (RL configs have no top_p).

Decode loop: a call without env (every single-turn rollout: the RL reasoning and coding tasks, the benchmarks)
takes `_single_turn`, which keeps the per-sample bookkeeping in arrays, searches stop strings only in samples whose
new token's text holds one of their characters, and launches step t + 1 before storing step t's tokens, one host
copy per step; through decode graphs without stop strings it launches step t + 1 from the device's sampled tokens
before the host has seen them, so the GPU does not wait for the host; multi-turn calls take the general per-sample loop. Both give the same samples, bit for bit
(tests/rollout/test_generate.py compares them with `single_turn_path` off).

GPU: decode steps replay CUDA graphs (trace/rollout/graphs.py: all B rows, one graph per 256-slot attention
bucket, kept across calls until the next sync_weights; `prepare(batch, prompt_len, new_tokens)` captures
them up front); prefill and multi-token chunks run eagerly. Experts are grouped GEMMs (torch._grouped_mm)
and BF16 decode attention is one SDPA call over each KV head's query rows with the length mask. In w4a4 mode `fp4_backend`
picks how the FP4 numbers are computed: "torch" = FP4 weights dequantized at sync + per-row FP4
activation quant + BF16 GEMMs (the same codes on BF16 tensor cores), FP4 KV decoded once per token;
"triton" (the default on CUDA for NVFP4, "auto") = the FP4 kernels of kernels/ for decode steps (FP4
weights and FP4 KV codes read from memory), the torch path for prefill. Measured on an H200
(results/rollout/rollout.csv): BF16 engine 17.5-18.8x transformers generate; W4A4 + FP4 KV on the Triton
path 1.50x the engine's BF16 tokens per second at batch 256 with 1k generation (kernels/NOTES.md,
"The engine's decode step").
Recording (a `recorder`) runs the path that generates: decode steps on the Triton path record the codes
its kernels quantized (trace/rollout/fast.py), so a TRACE rollout samples from the same kernels as the
other FP4 arms' rollouts; on a GPU its one-token decode steps record inside their CUDA graphs
(graphs.StepRecording: device buffers written at the step index, handed to the recorder every
RECORD_WINDOW steps and after the call); prefill and multi-token chunks (observations of a multi-turn
call) record eagerly.

Stops: `stop_token_ids` finish a sample (e.g. pass `(EOS_ID,)`; nothing is implicit); a stop string
(needs `tokenizer`) ends the turn and is kept in the output; `max_new_tokens` caps the policy tokens
of each turn; the context (`max_seq_len`, default `config.max_position_embeddings`) caps the total.
`stop_reason` is one of "stop_token", "stop_string", "length", "context", "env_done", "max_turns".
With recording on, the last sampled token of every sample is also fed once, after generation, so that
every (seq, pos) of every sample is in the record (the trainer's forward sees every token).

Timing: `elapsed_s` is the whole call; `record_s` the part of it spent recording (the recorder's calls,
with device work awaited on both sides on CUDA, and the final feed that exists only for the record),
so `elapsed_s - record_s` is generation alone. Inside recording graphs, the buffer writes are part of the
step and so of generation; `record_s` counts handing the rows over after the call.

Compared against: transformers forward / patched QAT model (tests/rollout/test_engine.py); batch vs
alone and seeds in tests/rollout/test_generate.py. Run: `.venv/bin/python -m pytest tests/rollout -q`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from trace import fp4
from trace.guidance import Recording, Rows
from trace.rollout import fast
from trace.rollout.cache import KVCache
from trace.rollout.forward import EngineForward
from trace.rollout.graphs import DecodeGraphs, StepRecording, record_spec
from trace.rollout.weights import Arch, EngineWeights

MODES = ("bf16", "w4a4")
NONFINITE = "the engine produced non-finite logits (NaN/inf); the weights or inputs are broken"
# decode steps a recording graph keeps on the device before handing them to the recorder: bounds its
# buffers (64 x batch x the record's bytes per token) whatever the generation length
RECORD_WINDOW = 64


class _TimedRecorder:
    """A recorder whose calls (other than `wants`) add their wall time to `elapsed`; on CUDA the device
    is synchronized on both sides of each call, so queued generation work is not charged to it."""

    def __init__(self, recorder, cuda: bool):
        self._recorder, self._cuda, self.elapsed, self._inside = recorder, cuda, 0.0, False

    def wants(self, layer: int) -> bool:
        return self._recorder.wants(layer)

    def timed(self, fn, *args, **kwargs):
        """fn(*args, **kwargs), its wall time charged to the recording (once, however nested)."""
        if self._inside:
            return fn(*args, **kwargs)
        if self._cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self._inside = True
        try:
            out = fn(*args, **kwargs)
            if self._cuda:
                torch.cuda.synchronize()
        finally:
            self._inside = False
            self.elapsed += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        attr = getattr(self._recorder, name)
        if not callable(attr):
            return attr
        return lambda *a, **k: self.timed(attr, *a, **k)


@dataclass
class RolloutBatch:
    tokens: list[list[int]]  # per sample: prompt + generated (+ env) token ids
    prompt_lens: list[int]
    logprobs: list[list[float]]  # per sample, per token after the prompt (0.0 for env tokens)
    trainable: list[list[bool]]  # per sample, aligned with tokens[prompt_len:]
    prompt_index: list[int]  # which prompt each sample came from (samples of a prompt are contiguous)
    seq_ids: list[int]  # record address of each sample (= sample index)
    finished: list[bool]  # ended naturally (stop token/string, env done, max_turns); False = truncated
    stop_reason: list[str]
    num_generated_tokens: int  # policy tokens sampled (env tokens excluded)
    elapsed_s: float  # the whole generate call
    turns: list[int] = field(default_factory=list)  # completed environment turns per sample
    record_s: float = 0.0  # part of elapsed_s spent recording (0 without a recorder)
    record_feed_s: float = 0.0  # part of record_s: the forward that feeds finished samples' last tokens for the
    #                             record, without the recorders' own storing (their `seconds` hold it)

    @property
    def generate_s(self) -> float:
        """Generation alone: the call's wall time less the recording's."""
        return self.elapsed_s - self.record_s

    def response_tokens(self, i: int) -> list[int]:
        return self.tokens[i][self.prompt_lens[i]:]

    def texts(self, tokenizer) -> list[str]:
        """Decoded responses (everything after the prompt)."""
        return [tokenizer.decode(self.response_tokens(i)) for i in range(len(self.tokens))]


def _call_env(env, i: int, text: str):
    step = getattr(env, "step", None)
    out = step(i, text) if step is not None else env(i, text)
    if not (isinstance(out, tuple) and len(out) >= 2):
        raise ValueError(f"env.step(sample_index, text) must return (observation_text, done), got {out!r}")
    return str(out[0]), bool(out[-1])


class _StopText:
    """Stop strings for `_single_turn`: which samples' newest token completes one, with Python work only for the
    samples whose token's text holds a character of a stop string. The general loop appends every token's text
    (`tokenizer.decode([token])`) to the sample's turn and searches the whole turn; a live sample's turn holds no
    stop string yet, so one that appears now overlaps the new token's text (which then holds one of its characters)
    and starts within the turn's last `keep` characters before it: searching those and the new text is the same
    test."""

    def __init__(self, stop_strings, tokenizer, vocab: int):
        self.stops = tuple(stop_strings)
        self.chars = set("".join(self.stops))
        self.keep = max(len(x) for x in self.stops) - 1
        self.empty = "" in self.stops
        self.tok = tokenizer
        self.piece: dict[int, str] = {}  # token id -> its text, for every token sampled in the call
        self.known = np.zeros(vocab, dtype=bool)
        # a token whose text may complete a stop string (every token if one is empty: "" is in every text)
        self.maybe = np.zeros(vocab, dtype=bool)
        # a token whose own text holds a whole stop string: it stops its sample whatever came before
        self.sure = np.zeros(vocab, dtype=bool)
        self.new_sure: list[int] = []  # such tokens first seen by the last `hits`

    def hits(self, tok: np.ndarray, samples: np.ndarray, before: np.ndarray) -> np.ndarray:
        """tok [A]: the tokens just sampled by `samples` [A]; before [t, B]: each sample's earlier tokens of the
        turn (rows are steps). -> [A] bool: the sample's turn now holds a stop string."""
        new = np.unique(tok)
        self.new_sure = []
        for u in new[~self.known[new]].tolist():
            p = self.piece[u] = self.tok.decode([u])
            self.known[u], self.maybe[u] = True, self.empty or any(c in self.chars for c in p)
            if any(x in p for x in self.stops):
                self.sure[u] = True
                self.new_sure.append(u)
        out = np.zeros(tok.shape, dtype=bool)
        for j in np.flatnonzero(self.maybe[tok]).tolist():
            b, text = int(samples[j]), self.piece[int(tok[j])]
            head, i = "", before.shape[0] - 1  # the turn's text before this token, back to `keep` characters
            while len(head) < self.keep and i >= 0:  # (or the turn's start), a few tokens back
                head = self.piece[int(before[i, b])] + head
                i -= 1
            text = head[-self.keep:] + text if self.keep > 0 else text
            out[j] = any(x in text for x in self.stops)
        return out


def default_dtype(device) -> torch.dtype:
    """The engine's compute dtype when none is given: BF16 on CUDA, the production path (CUDA-graph decode,
    the Triton FP4 kernels, the same BF16 weights the BF16-autocast trainer computes with); FP32 on the
    CPU, where BF16 matmuls are emulated and slow and the smoke profile's numbers were made."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


class RolloutEngine:
    def __init__(self, config, *, mode: str = "bf16", fmt: str = "nvfp4", kv_fp4: bool = False,
                 dtype: torch.dtype | None = None, device="cpu", max_seq_len: int | None = None,
                 cuda_graphs: bool = True, fp4_backend: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if fmt not in fp4.FORMATS:
            raise ValueError(f"fmt must be one of {fp4.FORMATS}, got {fmt!r}")
        dtype = default_dtype(device) if dtype is None else dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        if fp4_backend not in fast.BACKENDS:
            raise ValueError(f"fp4_backend must be one of {fast.BACKENDS}, got {fp4_backend!r}")
        self.config, self.mode, self.fmt, self.kv_fp4 = config, mode, fmt, kv_fp4
        self.fp4_backend = fp4_backend
        self.dtype, self.device = dtype, torch.device(device)
        self.arch = Arch.from_config(config)
        self.max_seq_len = int(max_seq_len or self.arch.max_pos)
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        self.weights: EngineWeights | None = None
        self.fwd: EngineForward | None = None
        # decode steps replay CUDA graphs (trace/rollout/graphs.py) on a GPU when nothing is recorded; a
        # float32 forward on CUDA cannot be captured (its grouped GEMM loops over host-side offsets)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda" and self.dtype == torch.bfloat16
        self._kept = None  # (key, KVCache, DecodeGraphs) reused across calls with graphs on
        self.graph_bucket = 256  # attention slots per decode graph (graphs.DecodeGraphs); 1 = one per length
        self._fast_checked = False  # the Triton path's self-test at this model's shapes (fast.TritonPath)
        self.single_turn_path = True  # calls without env take `_single_turn`; off: the general loop (tests compare)

    # ------------------------------------------------------------------------------ weights
    def sync_weights(self, model_or_state_dict) -> None:
        """(Re)load the policy's weights; in w4a4 mode re-quantize them from the master weights."""
        self._kept = None  # captured graphs point at the old weight tensors
        self.weights = EngineWeights.load(self.arch, model_or_state_dict, self.mode, self.fmt, self.dtype,
                                          self.device)
        self.fwd = EngineForward(self.weights, mode=self.mode, fmt=self.fmt, dtype=self.dtype)
        self.fwd.fused = fast.fused_ops(self.device, self.dtype, self.fp4_backend)
        if self.mode == "w4a4" and self.fmt == "nvfp4" and fast.available(self.device, self.dtype, self.fp4_backend):
            path = fast.TritonPath.build(self.weights)
            if self.device.type == "cuda" and not self._fast_checked:  # once per engine: shapes do not change
                path.self_test(self.weights, self.dtype, self.device)
                self._fast_checked = True
            self.fwd.fast = path

    def _check_ready(self):
        if self.fwd is None:
            raise RuntimeError("call sync_weights(model_or_state_dict) before generating")

    def _new_cache(self, batch: int, cap: int) -> KVCache:
        a = self.arch
        # FP4 codes in the cache only where a kernel reads them (the Triton decode attention); the torch
        # path keeps the decoded values (same numbers, decoded once per token instead of once per step)
        store = "codes" if self.fwd is not None and self.fwd.fast is not None else "values"
        return KVCache(a.num_layers, batch, cap, a.num_kv_heads, a.head_dim, dtype=self.dtype, device=self.device,
                       fp4_kv=self.kv_fp4, fmt=self.fmt, fp4_store=store)

    def _cache_and_graphs(self, batch: int, cap: int, recorder=None):
        """The KV cache (and decode graphs, on a GPU) for a generate call. With graphs, the pair is kept for
        the next call of the same (batch, cap, what is recorded): every slot a step attends to is written
        earlier in the same call, so stale contents are never read. A recorder gets graphs that record
        (graphs.StepRecording, buffers for a window of RECORD_WINDOW decode steps, flushed when full)."""
        if not self.cuda_graphs:
            return self._new_cache(batch, cap), None
        spec = None if recorder is None else record_spec(recorder, self.arch.num_layers)
        key = (batch, cap, spec)
        if self._kept is None or self._kept[0] != key:
            self._kept = None  # free the old pair first
            cache = self._new_cache(batch, cap)
            rec = None if spec is None else StepRecording(spec, batch, min(RECORD_WINDOW, cap), self.device)
            self._kept = (key, cache, DecodeGraphs(self.fwd, cache, self.graph_bucket, recording=rec))
        return self._kept[1], self._kept[2]

    def prepare(self, batch: int, max_prompt_len: int, max_new_tokens: int, recorder=None) -> None:
        """Allocate the cache of a generate call of `batch` samples (prompts * n) and capture its decode
        graphs now rather than during the first call (no-op without CUDA graphs); with `recorder`, the
        recording graphs of calls that pass a recorder of the same kind (graphs.record_spec)."""
        self._check_ready()
        if self.cuda_graphs:
            cap = min(self.max_seq_len, max_prompt_len + max_new_tokens)
            self._cache_and_graphs(batch, cap, recorder)[1].capture_all()

    def _check_prompts(self, prompts, what="prompt"):
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise ValueError(f"need a non-empty list of {what}s (lists of token ids)")
        for j, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"{what} {j} is empty")
            if len(p) >= self.max_seq_len:
                raise ValueError(f"{what} {j} has {len(p)} tokens; the context is {self.max_seq_len} "
                                 f"(max_seq_len), leaving no room to generate")
            bad = [t for t in p if not 0 <= int(t) < self.arch.vocab]
            if bad:
                raise ValueError(f"{what} {j} has token ids outside [0, {self.arch.vocab}): {bad[:5]}")

    def _chunk(self, cache, seqs: list[list[int]], starts: list[int], rows: list[int], recorder, seq_ids,
               all_logits=False):
        """Feed token lists seqs[r] at positions starts[r].. into cache rows rows[r]."""
        R, T = len(seqs), max(len(s) for s in seqs)
        ids = torch.zeros(R, T, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        dev = self.device
        lens = torch.tensor([len(s) for s in seqs], device=dev)
        start = torch.tensor(starts, device=dev)
        rows_t = None if rows == list(range(cache.batch)) else torch.tensor(rows, device=dev)
        rec = None
        if recorder is not None:
            t = torch.arange(T)
            pos = torch.where(t[None, :] < lens.cpu()[:, None], torch.tensor(starts)[:, None] + t, -1)  # [R, T]
            rec = Recording(recorder, Rows.of_batch(torch.tensor(seq_ids, device=dev), pos.to(dev)))
        max_len = max(st + len(sq) for st, sq in zip(starts, seqs, strict=False))
        causal = all(st == 0 for st in starts)  # a fresh prefill: then max_len == T
        return self.fwd(ids.to(dev), start, lens, rows_t, cache, rec, all_logits, max_len, causal)

    @staticmethod
    def _open_window(graphs: DecodeGraphs, steps: list, recorder) -> list:
        """Before a recording decode step: hands the recorded steps to the recorder when the window of buffers is full
        (the next step's index into them is then 0). Returns the steps not yet handed over."""
        if len(steps) == graphs.recording.max_steps:
            recorder.timed(graphs.recording.flush, recorder._recorder, steps)
            return []
        return steps

    def _rows_on_device(self, go: np.ndarray, B: int):
        """The rows to sample from next ([A] on the device; None: all B in order), copied without waiting for the
        step just launched (a pinned buffer on a GPU)."""
        if go.size == B:
            return None
        rows = torch.from_numpy(go)
        return rows.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else rows

    def _decode_all(self, graphs: DecodeGraphs, ids: np.ndarray, lens: np.ndarray, fed: np.ndarray, steps: list,
                    recorder) -> tuple[torch.Tensor, list]:
        """One-token step for every cache row through the CUDA graphs. ids [B]: the token each row feeds; lens [B]:
        1 where a row feeds it, 0 where it feeds nothing; fed [B]: the tokens already in each row (its position).
        With recording graphs, the rows fed are noted in `steps` (handed to the recorder first when the window is
        full; the step's index into the buffers is its place there). Returns (logits [B, V] (row b = sample b),
        valid until the next call; steps)."""
        B, cap = graphs.cache.batch, graphs.cache.cap
        go = np.flatnonzero(lens)  # [A] the rows fed, ascending
        if graphs.recording is not None:
            steps = self._open_window(graphs, steps, recorder)
            steps.append(dict(zip(go.tolist(), fed[go].tolist(), strict=True)))
        host = torch.from_numpy(np.concatenate([ids, np.minimum(fed, cap - 1), lens, [len(steps) - 1 if steps else 0]]))
        dev = host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        # [3B + 1]: tokens, positions, fed or not, step index (one host-to-device copy)
        return graphs(dev[:B, None], dev[B:2 * B], dev[2 * B:3 * B], int(fed[go].max()) + 1, dev[3 * B:]), steps

    # ------------------------------------------------------------------------------ scoring
    def score(self, sequences: list[list[int]], *, recorder=None, seq_ids=None,
              temperature: float = 1.0) -> list[list[float]]:
        """Teacher-forced log-probs (at `temperature`) of tokens[1:] of each sequence, from ONE full-sequence
        prefill (the engine's prefill numerics). With `recorder`, the prefill is recorded at
        (seq_ids[b] or b, position)."""
        if not temperature > 0:
            raise ValueError(f"scoring needs temperature > 0, got {temperature}")
        self._check_ready()
        self._check_prompts(sequences, "sequence")
        cache = self._new_cache(len(sequences), max(len(s) for s in sequences))
        ids = list(range(len(sequences))) if seq_ids is None else list(seq_ids)
        logits = self._chunk(cache, [list(s) for s in sequences], [0] * len(sequences), list(range(len(sequences))),
                             recorder, ids, all_logits=True)  # [B, T, V]
        self._check_logits(logits)
        lp = torch.log_softmax(logits.float() / temperature, dim=-1).cpu()
        out = []
        for b, s in enumerate(sequences):
            tgt = torch.as_tensor(s[1:], dtype=torch.long)
            out.append(lp[b, : len(s) - 1].gather(-1, tgt[:, None]).squeeze(-1).tolist())
        return out

    @staticmethod
    def _check_logits(logits):
        if not bool(torch.isfinite(logits).all()):
            raise ValueError(NONFINITE)

    # ------------------------------------------------------------------------------ sampling
    @staticmethod
    @torch.profiler.record_function("rollout.sampling")  # a component of benchmarks/bench_rollout.py --breakdown
    def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator):
        """logits [A, V] -> (tokens [A], log-probs [A] under the sampling distribution at `temperature`;
        at temperature 1 for greedy, a flag [] that every logit is finite), all on the device, no host
        synchronisation. On a GPU without nucleus sampling: one pass of `kernels.sampling.fused_sample` (greedy the
        same tokens; sampling the same distribution from other random numbers: Gumbel keys from Philox, keyed by
        the generator's seed and offset, which it advances), where `_sample_torch`'s passes cost ~0.56 ms per step
        at 256 x 151,936 (kernels/NOTES.md v5e)."""
        if logits.is_cuda and top_p >= 1.0 and fast.fused_sampling():
            from kernels.sampling import fused_sample

            off = gen.get_offset()
            gen.set_offset(off + 4)  # Philox offsets advance by multiples of 4
            return fused_sample(logits, temperature, hash((gen.initial_seed(), off)))
        return RolloutEngine._sample_torch(logits, temperature, top_p, gen)

    @staticmethod
    def _sample_torch(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator):
        """`_sample` in torch passes over an fp32 copy of the logits (CPU, nucleus sampling, the reference)."""
        lf = logits.float()
        finite = torch.isfinite(lf).all()
        if temperature == 0:
            logp = torch.log_softmax(lf, dim=-1)
            tok = lf.argmax(-1)
        else:
            # one scaled copy for both (x / 1.0 is x exactly): each pass over [A, V] fp32 costs as much as a
            # small model's decode layer at rollout batch sizes
            z = lf if temperature == 1.0 else lf / temperature
            logp = torch.log_softmax(z, dim=-1)
            probs = torch.softmax(z, dim=-1)
            if top_p < 1.0:
                sp, si = probs.sort(-1, descending=True)
                keep = (sp.cumsum(-1) - sp) < top_p  # smallest prefix whose mass reaches top_p
                sp = sp * keep
                probs = torch.zeros_like(probs).scatter_(-1, si, sp)
            # torch.multinomial(probs, 1, generator=gen) draws exactly this (its one-sample path, ATen
            # native/Distributions.cpp: argmax(p / q), q ~ Exp(1) from the generator; same tokens, same
            # generator state, tests/rollout/test_generate.py) after checks of `probs` that cost two more
            # passes over [A, V] and a device-side assert on NaN, which `finite` reports instead
            q = torch.empty_like(probs).exponential_(1, generator=gen)
            tok = (probs / q).argmax(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1), finite

    @staticmethod
    def _to_host(tok: torch.Tensor, lp: torch.Tensor, finite: torch.Tensor):
        """One device-to-host copy of a step's samples: (tokens [A] int64, log-probs [A] float32) on the
        CPU; raises on non-finite logits."""
        return RolloutEngine._to_host_async(tok, lp, finite)()

    @staticmethod
    def _to_host_async(tok: torch.Tensor, lp: torch.Tensor, finite: torch.Tensor):
        """`_to_host` with the copy enqueued now (into pinned memory on a GPU) and waited for by the returned
        callable, so that work launched in between (the next decode step) does not delay it."""
        # float64 holds every token id and every float32 log-prob exactly
        d = torch.cat([tok.double(), lp.double(), finite.double()[None]])  # [2A + 1]
        ev = None
        if d.is_cuda:
            h = torch.empty(d.shape, dtype=d.dtype, pin_memory=True)
            h.copy_(d, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        else:
            h = d

        def wait():
            if ev is not None:
                ev.synchronize()
            if not bool(h[-1]):
                raise ValueError(NONFINITE)
            A = tok.shape[0]
            return h[:A].long(), h[A:2 * A].float()

        return wait

    # ------------------------------------------------------------------------------ generate
    def generate(self, prompts: list[list[int]], *, n: int = 1, max_new_tokens: int = 32, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0, stop_token_ids=(), stop_strings=(), tokenizer=None,
                 recorder=None, env=None, max_turns: int = 1) -> RolloutBatch:
        t0 = time.perf_counter()
        self._check_ready()
        self._check_prompts(prompts)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n (samples per prompt) must be an int >= 1, got {n!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0 or temperature != temperature:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        stop_strings = tuple(stop_strings)
        stop_ids = {int(t) for t in stop_token_ids}
        if (stop_strings or env is not None) and tokenizer is None:
            raise ValueError("stop_strings and env need the tokenizer (tokenizer=...)")
        if env is not None and not stop_strings:
            raise ValueError("multi-turn generation (env) needs stop_strings to know where a turn ends")

        P = len(prompts)
        B = P * n
        tokens = [list(map(int, prompts[b // n])) for b in range(B)]
        plens = [len(t) for t in tokens]
        cap = self.max_seq_len if env is not None else min(self.max_seq_len, max(plens) + max_new_tokens)
        cache, graphs = self._cache_and_graphs(B, cap, recorder)
        steps: list[dict[int, int]] = []  # rows fed by recording graph steps not yet flushed: {sample: position}
        if recorder is not None:
            recorder = _TimedRecorder(recorder, torch.device(self.device).type == "cuda")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))

        # Prefill each prompt once, into the row of its first sample; copy to the other samples.
        first = [p * n for p in range(P)]
        logits_p = self._chunk(cache, [tokens[b] for b in first], [0] * P, first, recorder, first)  # [P, V]
        if n > 1:
            src = torch.tensor(first, device=self.device).repeat_interleave(n - 1)
            dst = torch.tensor([b for b in range(B) if b % n], device=self.device)
            cache.copy_rows(src, dst)
            if recorder is not None:
                for b in range(B):
                    if b % n:
                        recorder.alias(b, b - b % n, plens[b])
        logits = logits_p.repeat_interleave(n, dim=0)  # [B, V]
        if env is None and self.single_turn_path:
            stops = _StopText(stop_strings, tokenizer, self.arch.vocab) if stop_strings else None
            return self._single_turn(t0, cache, graphs, logits, tokens, n, cap, max_new_tokens, temperature, top_p,
                                     gen, stop_ids, stops, recorder)
        fed = list(plens)  # tokens of each row already in the cache
        logps = [[] for _ in range(B)]
        trainable = [[] for _ in range(B)]
        finished, reason = [False] * B, [""] * B  # finished: no more tokens will be sampled
        turn_text, turn_count, turns = [""] * B, [0] * B, [0] * B
        tail: dict[int, list[int]] = {}
        n_gen = 0
        row_of = list(range(B))  # logits row of sample b

        while True:
            active = [b for b in range(B) if not finished[b]]
            if not active:
                break
            lrows = [row_of[b] for b in active]
            # every row active in order (most decode steps): no gather copy of the [B, V] logits
            lg = logits if lrows == list(range(logits.shape[0])) else logits[torch.tensor(lrows, device=logits.device)]
            tok, lp = self._to_host(*self._sample(lg, temperature, top_p, gen))
            tok, lp = tok.tolist(), lp.tolist()
            pending: dict[int, list[int]] = {}
            for j, b in enumerate(active):
                t = tok[j]
                tokens[b].append(t)
                logps[b].append(lp[j])
                trainable[b].append(True)
                n_gen += 1
                turn_count[b] += 1
                feed = [t]
                if stop_strings:
                    turn_text[b] += tokenizer.decode([t])
                if t in stop_ids:
                    finished[b], reason[b] = True, "stop_token"
                elif stop_strings and any(s in turn_text[b] for s in stop_strings):
                    if env is None:
                        finished[b], reason[b] = True, "stop_string"
                    else:
                        obs, done = _call_env(env, b, turn_text[b])
                        turns[b] += 1
                        room = cap - len(tokens[b])
                        obs_ids = [int(x) for x in tokenizer(obs, add_special_tokens=False)["input_ids"]] if obs else []
                        if len(obs_ids) > room:
                            obs_ids, done, reason[b] = obs_ids[:room], True, "context"
                        tokens[b].extend(obs_ids)
                        logps[b].extend([0.0] * len(obs_ids))
                        trainable[b].extend([False] * len(obs_ids))
                        feed += obs_ids
                        turn_text[b], turn_count[b] = "", 0
                        if done:
                            finished[b], reason[b] = True, reason[b] or "env_done"
                        elif turns[b] >= max_turns:
                            finished[b], reason[b] = True, "max_turns"
                if not finished[b]:
                    if len(tokens[b]) >= cap:
                        finished[b], reason[b] = True, ("length" if cap < self.max_seq_len else "context")
                    elif turn_count[b] >= max_new_tokens:
                        finished[b], reason[b] = True, "length"
                feed = feed[: max(0, cap - fed[b])]
                if feed and not finished[b]:
                    pending[b] = feed
                elif feed and recorder is not None:
                    tail[b] = feed  # fed after generation, only so that the record holds it
            if not pending:
                break
            if graphs is not None and all(len(f) == 1 for f in pending.values()):
                ids, lens = np.zeros(B, dtype=np.int64), np.zeros(B, dtype=np.int64)
                for b, f in pending.items():
                    ids[b], lens[b] = f[0], 1
                logits, steps = self._decode_all(graphs, ids, lens, np.array(fed, dtype=np.int64), steps, recorder)
                for b in pending:
                    fed[b] += 1
                row_of = list(range(B))
                continue
            rows = sorted(pending)
            out = self._chunk(cache, [pending[b] for b in rows], [fed[b] for b in rows], rows, recorder, rows)
            for r, b in enumerate(rows):
                fed[b] += len(pending[b])
                row_of[b] = r
            logits = out

        return self._finish(t0, cache, graphs, steps, tail, fed, recorder, tokens, plens, logps, trainable, n, reason,
                            n_gen, turns)

    def _finish(self, t0, cache, graphs, steps, tail, fed, recorder, tokens, plens, logps, trainable, n, reason, n_gen,
                turns) -> RolloutBatch:
        """Hand over the recording graphs' last window and feed the finished samples' last tokens (both only
        with a recorder), then the batch."""
        if steps:
            recorder.timed(graphs.recording.flush, recorder._recorder, steps)
        feed_s = 0.0
        if tail:
            rows = sorted(tail)
            before, own = recorder.elapsed, getattr(recorder._recorder, "seconds", 0.0)
            recorder.timed(self._chunk, cache, [tail[b] for b in rows], [fed[b] for b in rows], rows, recorder, rows)
            # the feed's forward alone: storing its rows is already in the recorders' own `seconds`
            feed_s = recorder.elapsed - before - (getattr(recorder._recorder, "seconds", 0.0) - own)
        B = len(tokens)
        return RolloutBatch(tokens=tokens, prompt_lens=plens, logprobs=logps, trainable=trainable,
                            prompt_index=[b // n for b in range(B)], seq_ids=list(range(B)),
                            finished=[r not in ("length", "context") for r in reason],
                            stop_reason=reason, num_generated_tokens=n_gen, elapsed_s=time.perf_counter() - t0,
                            turns=turns, record_s=recorder.elapsed if recorder is not None else 0.0,
                            record_feed_s=feed_s)

    def _single_turn(self, t0, cache, graphs, logits, tokens, n, cap, max_new_tokens, temperature, top_p, gen,
                     stop_ids, stops, recorder) -> RolloutBatch:
        """The decode loop of a call without env (the single-turn tasks' RL rollouts, the benchmarks): the tokens,
        log-probs, stop reasons and record of the general loop in `generate`, bit for bit
        (tests/rollout/test_generate.py), with the per-sample bookkeeping on whole arrays. In each step the host
        waits for one copy of the sampled tokens, decides with a few array operations which samples go on (a stop
        token, a stop string (`_StopText`), the context, max_new_tokens: every live sample has sampled the same
        number of tokens), launches the next step and only then stores this step's tokens, so the GPU waits for
        the copy and those few operations, not for a Python loop over the samples (benchmarks/engine_host_loop.py
        measures what remains). Through decode graphs the next step is launched before the host waits for the
        copy, from the device's sampled tokens, so the GPU runs it while the host does its bookkeeping (the host's
        0.6-1.5 ms per step had the H200 idle ~20% of a step: kernels/NOTES.md v5h): the device feeds each sampled
        token whose row goes on as far as it can tell (not a stop token, not a token whose own text holds a stop
        string, the context not reached; `max_new_tokens` is the same step for every row). Its attention bucket is
        the longest row that may go on. Two guesses can be wrong, and then the step runs again as the general loop
        runs it, writing the same slots, so the result is the general loop's bit for bit: the rows that went on fit
        a smaller bucket (the longest stopped), or a row went on whose stop string spans earlier tokens or whose
        token was not yet decoded (once per token and call: RL's one-character stop strings are then decided on
        the device)."""
        B = len(tokens)
        plen = np.array([len(t) for t in tokens], dtype=np.int64)  # [B]
        stop = np.array(sorted(stop_ids), dtype=np.int64)
        steps_max = int(min(max_new_tokens, cap - plen.min()))
        out_tok = np.zeros((steps_max, B), dtype=np.int64)  # [step, sample]: token sampled at that step
        out_lp = np.zeros((steps_max, B), dtype=np.float32)
        count = np.zeros(B, dtype=np.int64)  # tokens sampled per sample
        fed = plen.copy()  # tokens of each cache row already in the cache
        reason = [""] * B
        tail: dict[int, list[int]] = {}
        steps: list[dict[int, int]] = []  # rows fed by recording graph steps not yet flushed: {sample: position}
        active = np.arange(B)  # samples still sampling, ascending
        lrow = None  # device rows of `logits` to sample from (None: all, in order)
        ctx = "length" if cap < self.max_seq_len else "context"
        ahead = graphs is not None  # the next step launched from the device's tokens
        sure_d = None
        if ahead:
            dev = self.device
            stop_d, plen_d = torch.as_tensor(stop, device=dev), torch.as_tensor(plen, device=dev)
            # [V] the device's copy of stops.sure (tokens that stop their sample by their own text)
            sure_d = torch.zeros(self.arch.vocab, dtype=torch.bool, device=dev) if stops is not None else None
            fed_d = plen_d.clone()  # [B] the device's copy of `fed`
            every = torch.arange(B, device=dev)
            rec = graphs.recording
            step_ix = torch.arange(rec.max_steps, device=dev) if rec is not None else None
        for t in range(steps_max):
            lg = logits if lrow is None else logits.index_select(0, lrow)
            sampled = self._sample(lg, temperature, top_p, gen)
            nxt = None
            may = plen[active] + t + 1 < cap  # [A] rows that go on unless they sampled a stop token
            if ahead and t + 1 < max_new_tokens and may.any():
                tok_d, rows_d = sampled[0].long(), every if lrow is None else lrow
                keep = (plen_d[rows_d] + (t + 1) < cap) & ~torch.isin(tok_d, stop_d)  # [A], as `go` below
                if sure_d is not None:
                    keep &= ~sure_d[tok_d]
                ids_d = torch.zeros(B, dtype=torch.long, device=dev).index_put_((rows_d,), torch.where(keep, tok_d, 0))
                lens_d = torch.zeros(B, dtype=torch.long, device=dev).index_put_((rows_d,), keep.long())
                start_d = fed_d.clamp(max=cap - 1)
                if rec is not None:
                    steps = self._open_window(graphs, steps, recorder)
                ix = step_ix[len(steps):len(steps) + 1] if rec is not None else None
                pred = int(fed[active[may]].max()) + 1
                wait = self._to_host_async(*sampled)  # the copy goes first in the stream, the step after it
                nxt = (graphs(ids_d[:, None], start_d, lens_d, pred, ix), ids_d, start_d, lens_d, pred, ix)
                fed_d += lens_d
                tok_t, lp_t = wait()
            else:
                tok_t, lp_t = self._to_host(*sampled)
            tok, lp = tok_t.numpy(), lp_t.numpy()  # [A]
            # the general loop's order of stop reasons: stop token, stop string, the context, max_new_tokens
            is_stop = np.isin(tok, stop)
            is_str = stops.hits(tok, active, out_tok[:t]) if stops is not None else np.zeros_like(is_stop)
            if sure_d is not None and stops.new_sure:  # small: only tokens whose text holds a stop string
                sure_d[torch.tensor(stops.new_sure, device=self.device)] = True
            cap_hit = plen[active] + t + 1 >= cap
            fin = is_stop | is_str | cap_hit | (t + 1 >= max_new_tokens)
            go = active[~fin]  # [A'] samples fed now, ascending
            for j in np.flatnonzero(fin).tolist():
                b = int(active[j])
                reason[b] = ("stop_token" if is_stop[j] else "stop_string" if is_str[j] else ctx if cap_hit[j]
                             else "length")
                if recorder is not None:
                    tail[b] = [int(tok[j])]  # fed after generation, only so that the record holds it
            if go.size:
                feed = tok[~fin]
                if nxt is not None:  # launched above with the rows the device kept
                    logits, ids_d, start_d, lens_d, pred, ix = nxt
                    exact = int(fed[go].max()) + 1
                    again = graphs.span(exact) != graphs.span(pred)  # the general loop's bucket
                    if stops is not None:  # rows the device fed that a stop string stopped: fed nothing there
                        # the device dropped the rows whose token it knew as stopping: known before this step's
                        # `hits`, i.e. sure now and not first seen now
                        known = stops.sure[tok] & ~np.isin(tok, stops.new_sure)
                        wrong = active[is_str & ~is_stop & ~cap_hit & ~known]
                        if wrong.size:
                            w = torch.as_tensor(wrong, device=self.device)
                            ids_d[w], lens_d[w] = 0, 0
                            fed_d[w] -= 1
                            again = True
                    if again:  # the general loop's step: the same step again
                        logits = graphs(ids_d[:, None], start_d, lens_d, exact, ix)
                    if rec is not None:
                        steps.append(dict(zip(go.tolist(), fed[go].tolist(), strict=True)))
                    lrow = self._rows_on_device(go, B)
                elif graphs is not None:
                    ids, lens = np.zeros(B, dtype=np.int64), np.zeros(B, dtype=np.int64)
                    ids[go], lens[go] = feed, 1
                    logits, steps = self._decode_all(graphs, ids, lens, fed, steps, recorder)
                    lrow = self._rows_on_device(go, B)
                else:
                    rows = go.tolist()
                    logits = self._chunk(cache, [[x] for x in feed.tolist()], fed[go].tolist(), rows, recorder, rows)
                    lrow = None  # the chunk's logits are the fed rows', in order
                fed[go] += 1
            # stored while the step runs
            out_tok[t, active], out_lp[t, active] = tok, lp
            count[active] += 1
            active = go
            if not go.size:
                break
        new_tok, new_lp = out_tok.T.tolist(), out_lp.T.tolist()  # [B][steps]
        logps = [new_lp[b][: count[b]] for b in range(B)]
        for b in range(B):
            tokens[b] += new_tok[b][: count[b]]
        trainable = [[True] * int(c) for c in count]
        plens = plen.tolist()
        return self._finish(t0, cache, graphs, steps, tail, fed.tolist(), recorder, tokens, plens, logps, trainable, n,
                            reason, int(count.sum()), [0] * B)
