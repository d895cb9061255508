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

Step API (what the decode loops of trace/rollout/decode.py call; public so that they, benchmarks and tests use
no private names):
    logits = eng.feed(cache, seqs, starts, rows, recorder, seq_ids)   # forward of one chunk into cache rows
    tok, lp, finite = eng.sample(logits, temperature, top_p, gen)      # next tokens, on the device, no sync
    tok, lp = eng.to_host(tok, lp, finite)                             # one copy to the CPU; raises on NaN/inf
    wait = eng.to_host_async(tok, lp, finite); ...; tok, lp = wait()  # the copy enqueued, waited for later
`sample_torch` is `sample` in torch passes (the CPU, nucleus sampling, the fused sampler's reference).

Decode loop (trace/rollout/decode.py): a call without env (every single-turn rollout: the RL reasoning and coding
tasks, the benchmarks) runs `SingleTurnLoop` (bookkeeping in arrays; through decode graphs it launches step t + 1
from the device's sampled tokens before the host has seen them); multi-turn calls run the per-sample
`GeneralLoop`. Both give the same samples, bit for bit (tests/rollout/test_generate.py compares them with
`single_turn_path` off).

GPU: decode steps replay CUDA graphs (trace/rollout/graphs.py: all B rows, one graph per 256-slot attention
bucket, kept across calls and weight syncs: a sync copies the new weights into the captured tensors;
`prepare(batch, prompt_len, new_tokens)` captures them up front); prefill and multi-token chunks run eagerly. Experts are grouped GEMMs (torch._grouped_mm)
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

Batch-invariant mode (`batch_invariant=True`; W4A4 + FP4 KV, NVFP4, the Triton kernels on a GPU or in the
interpreter): the forward runs every chunk on the kernels' batch-invariant configs (trace/rollout/forward.py) and a
sampled token's log-prob comes from the per-row kernel `kernels.batch_invariant.token_logprobs`, as `score`'s do, so
`score` over the generated sequences returns the rollout's log-probs bit for bit (the exact arm's trainer values;
tests/rollout/test_batch_invariant_engine.py).

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

import os
import time

import torch

from trace import fp4
from trace.guidance import Recording, Rows
from trace.rollout import fast
from trace.rollout.cache import KVCache
from trace.rollout.decode import GeneralLoop, RolloutBatch, SingleTurnLoop, TimedRecorder
from trace.rollout.forward import EngineForward
from trace.rollout.graphs import DecodeGraphs, StepRecording, record_spec
from trace.rollout.weights import Arch, EngineWeights, copy_into

MODES = ("bf16", "w4a4")
NONFINITE = "the engine produced non-finite logits (NaN/inf); the weights or inputs are broken"
# decode steps a recording graph keeps on the device before handing them to the recorder: bounds its
# buffers (64 x batch x the record's bytes per token) whatever the generation length
RECORD_WINDOW = 64


def default_dtype(device) -> torch.dtype:
    """The engine's compute dtype when none is given: BF16 on CUDA, the production path (CUDA-graph decode,
    the Triton FP4 kernels, the same BF16 weights the BF16-autocast trainer computes with); FP32 on the
    CPU, where BF16 matmuls are emulated and slow and the smoke profile's numbers were made."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


class RolloutEngine:
    def __init__(self, config, *, mode: str = "bf16", fmt: str = "nvfp4", kv_fp4: bool = False,
                 dtype: torch.dtype | None = None, device="cpu", max_seq_len: int | None = None,
                 cuda_graphs: bool = True, fp4_backend: str = "auto", batch_invariant: bool = False):
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
        self.batch_invariant = bool(batch_invariant)
        if self.batch_invariant:
            self._check_batch_invariant(device, dtype)
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
        self.single_turn_path = True  # calls without env run `SingleTurnLoop`; off: the general loop (tests compare)
        self._synced: set[str] = set()  # names loaded by sync_tensor since the last finish_sync
        self._replaced = False  # a sync_tensor replaced a held tensor by one of another kind

    # ------------------------------------------------------------------------------ weights
    def sync_weights(self, model_or_state_dict, inv_freq: torch.Tensor | None = None) -> None:
        """(Re)load the policy's weights; in w4a4 mode re-quantize them from the master weights. A later sync
        copies the new values into the tensors the engine already holds (`weights.copy_into`), so the kept KV
        cache and decode graphs, which read the weights by address, stay valid and the next generate call
        replays them instead of capturing new ones; a sync whose tensors differ in shape or kind starts over.
        inv_freq: the RoPE frequencies for a state dict (which carries parameters only; default: computed from
        the config), e.g. the first synced model's own buffer, which a BF16 model holds BF16-rounded."""
        weights = EngineWeights.load(self.arch, model_or_state_dict, self.mode, self.fmt, self.dtype, self.device,
                                     inv_freq)
        path = self._triton_path(weights)

        def held(p):  # the kernels' prepared weights of a Triton path
            return None if p is None else (p.dense, p.moe)

        if self.fwd is not None and copy_into((self.weights, held(self.fwd.fast)), (weights, held(path))):
            return
        self._install(weights, path)

    def sync_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """One parameter of a sync that arrives a tensor at a time (OpenRLHF's broadcast): re-quantized into the
        weights the engine holds at once (`EngineWeights.load_tensor`: the same function and casts as
        `sync_weights`), so the caller can drop the tensor right away and no full copy of the policy is held
        beside the engine's. Call `finish_sync` after the last one. The engine must hold weights already (one
        `sync_weights` first); a name it computes nothing with is skipped, as `sync_weights` skips it."""
        self._check_ready(syncing=True)
        got = self.weights.load_tensor(name, tensor, self.mode, self.fmt)
        if got is None:
            return
        self._synced.add(name)
        self._replaced |= got == "replaced"

    def finish_sync(self) -> list[str]:
        """Close a per-tensor sync: a model that ties its embeddings and sent no lm_head gets the embeddings' values
        (as `sync_weights` given the tied state dict); the Triton path's prepared weights of every layer are re-laid
        from the new FP4 weights (in place, layer by layer); a sync that replaced a tensor of another kind rebuilds
        the forward (kept decode graphs dropped), as `sync_weights` does. Raises KeyError naming the parameters the
        engine holds that the sync did not bring (they would keep their old values). Returns the names synced."""
        self._check_ready(syncing=True)
        synced, self._synced = sorted(self._synced), set()
        replaced, self._replaced = self._replaced, False
        embed, head = "model.embed_tokens.weight", "lm_head.weight"
        if getattr(self.config, "tie_word_embeddings", False) and head not in synced and embed in synced:
            with torch.no_grad():
                if not copy_into(self.weights.lm_head, self.weights.embed):
                    self.weights.lm_head, replaced = self.weights.embed.clone(), True
            synced.append(head)
        missing = sorted(self.weights.names() - set(synced))
        if missing:
            raise KeyError(f"the weight sync did not bring {len(missing)} of the engine's parameters, e.g. "
                           f"{missing[:3]}; they would keep their old values")
        if replaced:
            self._install(self.weights, self._triton_path(self.weights))
        elif self.fwd.fast is not None:
            self.fwd.fast.refresh(self.weights)
        return synced

    def _triton_path(self, weights):
        if self.batch_invariant or (self.mode == "w4a4" and self.fmt == "nvfp4"
                                    and fast.available(self.device, self.dtype, self.fp4_backend)):
            return fast.TritonPath.build(weights, self.batch_invariant)
        return None

    def _install(self, weights: EngineWeights, path) -> None:
        """New weight tensors: a new forward over them (kept decode graphs point at the old ones)."""
        self._kept = None  # captured graphs point at the old weight tensors
        self.weights = weights
        self.fwd = EngineForward(self.weights, mode=self.mode, fmt=self.fmt, dtype=self.dtype)
        self.fwd.fused = fast.fused_ops(self.device, self.dtype, self.fp4_backend)
        if self.batch_invariant:
            self.fwd.batch_invariant()
        if path is not None:
            if self.device.type == "cuda" and not self._fast_checked:  # once per engine: shapes do not change
                path.self_test(self.weights, self.dtype, self.device)
                self._fast_checked = True
            self.fwd.fast = path

    def _check_batch_invariant(self, device, dtype) -> None:
        """The batch-invariant mode (DESIGN.md §4 "Exact on-policy arm") runs every op of W4A4 + FP4-KV NVFP4 on the
        kernels (`kernels.batch_invariant`): on a GPU, or on a CPU in the Triton interpreter (TRITON_INTERPRET=1)."""
        if self.mode != "w4a4" or self.fmt != "nvfp4" or not self.kv_fp4:
            raise ValueError("batch_invariant needs mode='w4a4', fmt='nvfp4' and kv_fp4=True (its kernels are W4A4 "
                             f"NVFP4 over the FP4 KV cache), got mode={self.mode!r}, fmt={self.fmt!r}, "
                             f"kv_fp4={self.kv_fp4}")
        if self.fp4_backend == "torch":
            raise ValueError("batch_invariant runs on the Triton kernels; fp4_backend='torch' excludes them")
        if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("batch_invariant on a CPU runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1 "
                             "before starting Python")
        if not fast.available(device, dtype, "triton"):
            raise ValueError("batch_invariant: the Triton kernels (kernels/) cannot be imported here")

    def _check_ready(self, syncing: bool = False):
        if self.fwd is None:
            raise RuntimeError("call sync_weights(model_or_state_dict) before generating")
        if self._synced and not syncing:
            raise RuntimeError("a per-tensor weight sync is open (sync_tensor without finish_sync): the engine holds "
                               "old and new weights mixed")

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

    # ------------------------------------------------------------------------------ the step API
    # What a decode loop (trace/rollout/decode.py) calls: `feed` runs the forward of one chunk, `sample` draws
    # the next tokens on the device, `to_host` / `to_host_async` bring them to the CPU. Decode graphs
    # (graphs.DecodeGraphs) are the one-token `feed` of every cache row, replayed.
    def feed(self, cache, seqs: list[list[int]], starts: list[int], rows: list[int], recorder, seq_ids,
             all_logits=False, streams=None):
        """Feed token lists seqs[r] at positions starts[r].. into cache rows rows[r] (a prefill, an observation
        or an eager decode step) and return the logits: [R, V] of each list's last token, or [R, T, V] of every
        token with `all_logits`. recorder: records the chunk at (seq_ids[r], position); streams: as `score`."""
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
        return self.fwd(ids.to(dev), start, lens, rows_t, cache, rec, all_logits, max_len, causal, streams)

    # ------------------------------------------------------------------------------ scoring
    def score(self, sequences: list[list[int]], *, recorder=None, seq_ids=None,
              temperature: float = 1.0, streams: list | None = None) -> list[list[float]]:
        """Teacher-forced log-probs (at `temperature`) of tokens[1:] of each sequence, from ONE full-sequence
        prefill (the engine's prefill numerics). With `recorder`, the prefill is recorded at
        (seq_ids[b] or b, position). streams (a list): gets the forward's residual stream [B, T, H] (right padded)
        entering each layer and the final norm's input (EngineForward)."""
        if not temperature > 0:
            raise ValueError(f"scoring needs temperature > 0, got {temperature}")
        self._check_ready()
        self._check_prompts(sequences, "sequence")
        cache = self._new_cache(len(sequences), max(len(s) for s in sequences))
        ids = list(range(len(sequences))) if seq_ids is None else list(seq_ids)
        logits = self.feed(cache, [list(s) for s in sequences], [0] * len(sequences), list(range(len(sequences))),
                           recorder, ids, all_logits=True, streams=streams)  # [B, T, V]
        self._check_logits(logits)
        if self.batch_invariant:  # the per-row kernel the rollout's sampled tokens' log-probs come from
            B, T, V = logits.shape
            tgt = torch.zeros(B, T, dtype=torch.long)
            for b, s in enumerate(sequences):
                tgt[b, : len(s) - 1] = torch.as_tensor(s[1:], dtype=torch.long)
            lp = self.fwd.fast.logprobs(logits.reshape(B * T, V), tgt.view(-1).to(self.device), temperature)
            lp = lp.view(B, T).cpu()
            return [lp[b, : len(s) - 1].tolist() for b, s in enumerate(sequences)]
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

    @staticmethod
    @torch.profiler.record_function("rollout.sampling")  # a component of benchmarks/bench_rollout.py --breakdown
    def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator):
        """logits [A, V] -> (tokens [A], log-probs [A] under the sampling distribution at `temperature`;
        at temperature 1 for greedy, a flag [] that every logit is finite), all on the device, no host
        synchronisation. On a GPU without nucleus sampling: one pass of `kernels.sampling.fused_sample` (greedy the
        same tokens; sampling the same distribution from other random numbers: Gumbel keys from Philox, keyed by
        the generator's seed and offset, which it advances), where `sample_torch`'s passes cost ~0.56 ms per step
        at 256 x 151,936 (kernels/NOTES.md, "Sampling")."""
        if logits.is_cuda and top_p >= 1.0 and fast.fused_sampling():
            from kernels.sampling import fused_sample

            off = gen.get_offset()
            gen.set_offset(off + 4)  # Philox offsets advance by multiples of 4
            return fused_sample(logits, temperature, hash((gen.initial_seed(), off)))
        return RolloutEngine.sample_torch(logits, temperature, top_p, gen)

    @staticmethod
    def sample_torch(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator):
        """`sample` in torch passes over an fp32 copy of the logits (CPU, nucleus sampling, the reference)."""
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
    def to_host(tok: torch.Tensor, lp: torch.Tensor, finite: torch.Tensor):
        """One device-to-host copy of a step's samples: (tokens [A] int64, log-probs [A] float32) on the
        CPU; raises on non-finite logits."""
        return RolloutEngine.to_host_async(tok, lp, finite)()

    @staticmethod
    def to_host_async(tok: torch.Tensor, lp: torch.Tensor, finite: torch.Tensor):
        """`to_host` with the copy enqueued now (into pinned memory on a GPU) and waited for by the returned
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
        if recorder is not None:
            recorder = TimedRecorder(recorder, torch.device(self.device).type == "cuda")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))

        # Prefill each prompt once, into the row of its first sample; copy to the other samples.
        first = [p * n for p in range(P)]
        logits_p = self.feed(cache, [tokens[b] for b in first], [0] * P, first, recorder, first)  # [P, V]
        if n > 1:
            src = torch.tensor(first, device=self.device).repeat_interleave(n - 1)
            dst = torch.tensor([b for b in range(B) if b % n], device=self.device)
            cache.copy_rows(src, dst)
            if recorder is not None:
                for b in range(B):
                    if b % n:
                        recorder.alias(b, b - b % n, plens[b])
        logits = logits_p.repeat_interleave(n, dim=0)  # [B, V]
        args = (self, cache, graphs, tokens, n, cap, max_new_tokens, temperature, top_p, gen, recorder, t0)
        if env is None and self.single_turn_path:
            return SingleTurnLoop(*args).run(logits, stop_ids, stop_strings, tokenizer)
        return GeneralLoop(*args).run(logits, stop_ids, stop_strings, tokenizer, env, max_turns)
