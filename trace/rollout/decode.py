"""The rollout engine's decode loops: what `RolloutEngine.generate` runs after the prefill.

What: one loop object per generate call holds the call's state (tokens, log-probs, stop reasons, the rows fed
by recording decode steps not yet handed to the recorder, the finished samples' last tokens) and runs
decode steps through the engine's step API (`RolloutEngine.feed`, `sample`, `to_host`, `to_host_async`) and its
decode graphs:

* `GeneralLoop`: per-sample bookkeeping in Python; multi-turn generation (a stop string ends a turn, the
  environment's observation is appended with trainable False and log-prob 0.0 and fed as one chunk).
* `SingleTurnLoop`: calls without env (every single-turn rollout: the RL reasoning and coding tasks, the
  benchmarks). It keeps the bookkeeping in arrays, searches stop strings only in samples whose new token's text
  holds one of their characters (`_StopText`), and launches step t + 1 before storing step t's tokens, one
  host copy per step; through decode graphs without stop strings it launches step t + 1 from the device's
  sampled tokens before the host has seen them, so the GPU does not wait for the host.

Both give the same samples, log-probs, stop reasons and record, bit for bit (tests/rollout/test_generate.py
compares them with `RolloutEngine.single_turn_path` off). `DecodeLoop.finish` hands over the recording graphs'
last window, feeds the finished samples' last tokens (both only with a recorder) and builds the RolloutBatch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from trace.rollout.graphs import DecodeGraphs


class TimedRecorder:
    """A recorder whose calls (other than `wants`) add their wall time to `elapsed`; on CUDA the device
    is synchronized on both sides of each call, so queued generation work is not charged to it. `generate`
    wraps its recorder in one before the prefill; the decode loops charge their own recording work with `timed`."""

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
    """Stop strings for `SingleTurnLoop`: which samples' newest token completes one, with Python work only for the
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



class DecodeLoop:
    """The state of one generate call's decode and the steps both loops share. tokens: each sample's prompt
    (extended in place); cache / graphs: the call's KV cache and decode graphs (None: eager chunks); cap: the
    call's context; gen: its seeded generator; recorder: a `TimedRecorder` or None; t0: the call's start."""

    def __init__(self, engine, cache, graphs: DecodeGraphs | None, tokens: list[list[int]], n: int, cap: int,
                 max_new_tokens: int, temperature: float, top_p: float, gen: torch.Generator, recorder, t0: float):
        self.eng, self.cache, self.graphs, self.tokens, self.n, self.cap = engine, cache, graphs, tokens, n, cap
        self.max_new_tokens, self.temperature, self.top_p, self.gen = max_new_tokens, temperature, top_p, gen
        self.recorder, self.t0 = recorder, t0
        self.B = len(tokens)
        self.plens = [len(t) for t in tokens]
        self.steps: list[dict[int, int]] = []  # rows fed by recording graph steps not yet flushed: {sample: position}
        self.tail: dict[int, list[int]] = {}  # finished samples' last tokens, fed after generation for the record

    def sample(self, logits: torch.Tensor):
        """(tokens, log-probs, finite flag) on the device (the engine's `sample`, which benchmarks may time)."""
        tok, lp, finite = self.eng.sample(logits, self.temperature, self.top_p, self.gen)
        if self.eng.batch_invariant:  # the log-prob from the per-row kernel the trainer's forward also takes
            lp = self.eng.fwd.fast.logprobs(logits, tok, self.temperature or 1.0)
        return tok, lp, finite

    def open_window(self) -> None:
        """Before a recording decode step: hands the recorded steps to the recorder when the window of buffers is
        full (the next step's index into them is then 0)."""
        if len(self.steps) == self.graphs.recording.max_steps:
            self.recorder.timed(self.graphs.recording.flush, self.recorder._recorder, self.steps)
            self.steps = []

    def rows_on_device(self, go: np.ndarray):
        """The rows to sample from next ([A] on the device; None: all B in order), copied without waiting for the
        step just launched (a pinned buffer on a GPU)."""
        if go.size == self.B:
            return None
        rows = torch.from_numpy(go)
        dev = self.eng.device
        return rows.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else rows

    def decode_all(self, ids: np.ndarray, lens: np.ndarray, fed: np.ndarray) -> torch.Tensor:
        """One-token step for every cache row through the decode graphs. ids [B]: the token each row feeds; lens
        [B]: 1 where a row feeds it, 0 where it feeds nothing; fed [B]: the tokens already in each row (its
        position). With recording graphs, the rows fed are noted in `steps` (handed to the recorder first when the
        window is full; the step's index into the buffers is its place there). Returns logits [B, V] (row b =
        sample b), valid until the next call."""
        graphs, B = self.graphs, self.B
        cap = graphs.cache.cap
        go = np.flatnonzero(lens)  # [A] the rows fed, ascending
        if graphs.recording is not None:
            self.open_window()
            self.steps.append(dict(zip(go.tolist(), fed[go].tolist(), strict=True)))
        host = torch.from_numpy(np.concatenate([ids, np.minimum(fed, cap - 1), lens,
                                                [len(self.steps) - 1 if self.steps else 0]]))
        dev = host.pin_memory().to(self.eng.device, non_blocking=True) if self.eng.device.type == "cuda" else host
        # [3B + 1]: tokens, positions, fed or not, step index (one host-to-device copy)
        return graphs(dev[:B, None], dev[B:2 * B], dev[2 * B:3 * B], int(fed[go].max()) + 1, dev[3 * B:])

    def finish(self, fed: list[int], logps, trainable, reason: list[str], n_gen: int, turns: list[int]) -> RolloutBatch:
        """Hand over the recording graphs' last window and feed the finished samples' last tokens (both only
        with a recorder), then the batch."""
        recorder, tail = self.recorder, self.tail
        if self.steps:
            recorder.timed(self.graphs.recording.flush, recorder._recorder, self.steps)
        feed_s = 0.0
        if tail:
            rows = sorted(tail)
            before, own = recorder.elapsed, getattr(recorder._recorder, "seconds", 0.0)
            recorder.timed(self.eng.feed, self.cache, [tail[b] for b in rows], [fed[b] for b in rows], rows,
                           recorder, rows)
            # the feed's forward alone: storing its rows is already in the recorders' own `seconds`
            feed_s = recorder.elapsed - before - (getattr(recorder._recorder, "seconds", 0.0) - own)
        B, n = self.B, self.n
        return RolloutBatch(tokens=self.tokens, prompt_lens=self.plens, logprobs=logps, trainable=trainable,
                            prompt_index=[b // n for b in range(B)], seq_ids=list(range(B)),
                            finished=[r not in ("length", "context") for r in reason],
                            stop_reason=reason, num_generated_tokens=n_gen, elapsed_s=time.perf_counter() - self.t0,
                            turns=turns, record_s=recorder.elapsed if recorder is not None else 0.0,
                            record_feed_s=feed_s)


class GeneralLoop(DecodeLoop):
    """The per-sample loop: any call, multi-turn ones (env) included. Each step samples every unfinished sample,
    appends its token (and, when a stop string ends a turn, the environment's observation), and feeds what each
    sample has to feed: one-token steps through the decode graphs when every sample feeds one token, else one
    chunk of the samples' new tokens at their own positions."""

    def run(self, logits: torch.Tensor, stop_ids: set[int], stop_strings: tuple, tokenizer, env,
            max_turns: int) -> RolloutBatch:
        B = self.B
        self.stop_ids, self.stop_strings, self.tokenizer, self.env, self.max_turns = (
            stop_ids, stop_strings, tokenizer, env, max_turns)
        self.fed = list(self.plens)  # tokens of each row already in the cache
        self.logps: list[list[float]] = [[] for _ in range(B)]
        self.trainable: list[list[bool]] = [[] for _ in range(B)]
        self.finished, self.reason = [False] * B, [""] * B  # finished: no more tokens will be sampled
        self.turn_text, self.turn_count, self.turns = [""] * B, [0] * B, [0] * B
        self.n_gen = 0
        row_of = list(range(B))  # logits row of sample b
        while True:
            active = [b for b in range(B) if not self.finished[b]]
            if not active:
                break
            lrows = [row_of[b] for b in active]
            # every row active in order (most decode steps): no gather copy of the [B, V] logits
            lg = logits if lrows == list(range(logits.shape[0])) else logits[torch.tensor(lrows, device=logits.device)]
            tok, lp = self.eng.to_host(*self.sample(lg))
            pending: dict[int, list[int]] = {}
            for b, t, p in zip(active, tok.tolist(), lp.tolist(), strict=True):
                feed = self._take(b, t, p)
                if feed and not self.finished[b]:
                    pending[b] = feed
                elif feed and self.recorder is not None:
                    self.tail[b] = feed  # fed after generation, only so that the record holds it
            if not pending:
                break
            logits, row_of = self._feed(pending, row_of)
        return self.finish(self.fed, self.logps, self.trainable, self.reason, self.n_gen, self.turns)

    def _take(self, b: int, t: int, lp: float) -> list[int]:
        """Sample b drew token t (log-prob lp): append it, decide whether the sample stops or its turn ends (then
        the environment's observation is appended). Returns the tokens the sample feeds next (within the cap)."""
        tokens, reason, stop_strings = self.tokens, self.reason, self.stop_strings
        tokens[b].append(t)
        self.logps[b].append(lp)
        self.trainable[b].append(True)
        self.n_gen += 1
        self.turn_count[b] += 1
        feed = [t]
        if stop_strings:
            self.turn_text[b] += self.tokenizer.decode([t])
        if t in self.stop_ids:
            self.finished[b], reason[b] = True, "stop_token"
        elif stop_strings and any(s in self.turn_text[b] for s in stop_strings):
            if self.env is None:
                self.finished[b], reason[b] = True, "stop_string"
            else:
                feed += self._observe(b)
        if not self.finished[b]:
            if len(tokens[b]) >= self.cap:
                self.finished[b], reason[b] = True, ("length" if self.cap < self.eng.max_seq_len else "context")
            elif self.turn_count[b] >= self.max_new_tokens:
                self.finished[b], reason[b] = True, "length"
        return feed[: max(0, self.cap - self.fed[b])]

    def _observe(self, b: int) -> list[int]:
        """Sample b's turn ended: the environment's observation (cut to the context) appended; returns its ids."""
        obs, done = _call_env(self.env, b, self.turn_text[b])
        self.turns[b] += 1
        room = self.cap - len(self.tokens[b])
        obs_ids = [int(x) for x in self.tokenizer(obs, add_special_tokens=False)["input_ids"]] if obs else []
        if len(obs_ids) > room:
            obs_ids, done, self.reason[b] = obs_ids[:room], True, "context"
        self.tokens[b].extend(obs_ids)
        self.logps[b].extend([0.0] * len(obs_ids))
        self.trainable[b].extend([False] * len(obs_ids))
        self.turn_text[b], self.turn_count[b] = "", 0
        if done:
            self.finished[b], self.reason[b] = True, self.reason[b] or "env_done"
        elif self.turns[b] >= self.max_turns:
            self.finished[b], self.reason[b] = True, "max_turns"
        return obs_ids

    def _feed(self, pending: dict[int, list[int]], row_of: list[int]):
        """Feed each pending sample's tokens; -> (logits, the logits row of each sample)."""
        B, fed = self.B, self.fed
        if self.graphs is not None and all(len(f) == 1 for f in pending.values()):
            ids, lens = np.zeros(B, dtype=np.int64), np.zeros(B, dtype=np.int64)
            for b, f in pending.items():
                ids[b], lens[b] = f[0], 1
            logits = self.decode_all(ids, lens, np.array(fed, dtype=np.int64))
            for b in pending:
                fed[b] += 1
            return logits, list(range(B))
        rows = sorted(pending)
        logits = self.eng.feed(self.cache, [pending[b] for b in rows], [fed[b] for b in rows], rows, self.recorder,
                               rows)
        for r, b in enumerate(rows):
            fed[b] += len(pending[b])
            row_of[b] = r
        return logits, row_of


class SingleTurnLoop(DecodeLoop):
    """The decode loop of a call without env (the single-turn tasks' RL rollouts, the benchmarks): the tokens,
    log-probs, stop reasons and record of `GeneralLoop`, bit for bit (tests/rollout/test_generate.py), with the
    per-sample bookkeeping on whole arrays. In each step the host waits for one copy of the sampled tokens,
    decides with a few array operations which samples go on (a stop token, a stop string (`_StopText`), the
    context, max_new_tokens: every live sample has sampled the same number of tokens), launches the next step
    and only then stores this step's tokens, so the GPU waits for the copy and those few operations, not for a
    Python loop over the samples (benchmarks/engine_host_loop.py measures what remains).

    Through decode graphs the next step is launched before the host waits for the copy, from the device's
    sampled tokens, so the GPU runs it while the host does its bookkeeping (which would otherwise leave the GPU
    idle for part of every step: kernels/NOTES.md, "The engine's decode step"): the device feeds each sampled
    token whose row goes on as far as it can tell (not a stop token, not a token whose own text holds a stop
    string, the context not reached; `max_new_tokens` is the same step for every row). Its attention bucket is the
    longest row that may go on. Two guesses can be wrong, and then the step runs again as the general loop runs it,
    writing the same slots, so the result is the general loop's bit for bit: the rows that went on fit a smaller
    bucket (the longest stopped), or a row went on whose stop string spans earlier tokens or whose token was not yet
    decoded (once per token and call: RL's one-character stop strings are then decided on the device)."""

    def run(self, logits: torch.Tensor, stop_ids: set[int], stop_strings: tuple, tokenizer) -> RolloutBatch:
        B = self.B
        self.stops = _StopText(stop_strings, tokenizer, self.eng.arch.vocab) if stop_strings else None
        self.plen = plen = np.array(self.plens, dtype=np.int64)  # [B]
        self.stop = np.array(sorted(stop_ids), dtype=np.int64)
        steps_max = int(min(self.max_new_tokens, self.cap - plen.min()))
        self.out_tok = np.zeros((steps_max, B), dtype=np.int64)  # [step, sample]: token sampled at that step
        self.out_lp = np.zeros((steps_max, B), dtype=np.float32)
        self.count = np.zeros(B, dtype=np.int64)  # tokens sampled per sample
        self.fed = plen.copy()  # tokens of each cache row already in the cache
        self.reason = [""] * B
        self.active = np.arange(B)  # samples still sampling, ascending
        self.lrow = None  # device rows of `logits` to sample from (None: all, in order)
        self.ahead = self.graphs is not None  # the next step launched from the device's tokens
        self.sure_d = None
        if self.ahead:
            self._device_state()
        for t in range(steps_max):
            lg = logits if self.lrow is None else logits.index_select(0, self.lrow)
            sampled = self.sample(lg)
            may = plen[self.active] + t + 1 < self.cap  # [A] rows that go on unless they sampled a stop token
            if self.ahead and t + 1 < self.max_new_tokens and may.any():
                nxt, (tok_t, lp_t) = self._launch_ahead(t, sampled, may)
            else:
                nxt, (tok_t, lp_t) = None, self.eng.to_host(*sampled)
            tok, lp = tok_t.numpy(), lp_t.numpy()  # [A]
            fin, stopped = self._stopped(t, tok)
            go = self.active[~fin]  # [A'] samples fed now, ascending
            if go.size:
                logits = self._feed(go, tok[~fin], tok, nxt, stopped)
            # stored while the step runs
            active = self.active
            self.out_tok[t, active], self.out_lp[t, active] = tok, lp
            self.count[active] += 1
            self.active = go
            if not go.size:
                break
        return self._result()

    def _device_state(self) -> None:
        """The device's copies of what the launched-ahead steps decide with."""
        self.dev = dev = self.eng.device
        self.stop_d, self.plen_d = torch.as_tensor(self.stop, device=dev), torch.as_tensor(self.plen, device=dev)
        # [V] the device's copy of stops.sure (tokens that stop their sample by their own text)
        self.sure_d = torch.zeros(self.eng.arch.vocab, dtype=torch.bool, device=dev) if self.stops is not None else None
        self.fed_d = self.plen_d.clone()  # [B] the device's copy of `fed`
        self.every = torch.arange(self.B, device=dev)
        self.rec = rec = self.graphs.recording
        self.step_ix = torch.arange(rec.max_steps, device=dev) if rec is not None else None

    def _launch_ahead(self, t: int, sampled, may: np.ndarray):
        """Launch step t + 1 from the device's sampled tokens, then wait for the host copy of step t's samples.
        -> ((logits, ids, starts, lens, bucket length, step index) of the launched step, (tokens, log-probs))."""
        B, cap, dev, rec = self.B, self.cap, self.dev, self.rec
        tok_d, rows_d = sampled[0].long(), self.every if self.lrow is None else self.lrow
        keep = (self.plen_d[rows_d] + (t + 1) < cap) & ~torch.isin(tok_d, self.stop_d)  # [A], as `go` in _stopped
        if self.sure_d is not None:
            keep &= ~self.sure_d[tok_d]
        ids_d = torch.zeros(B, dtype=torch.long, device=dev).index_put_((rows_d,), torch.where(keep, tok_d, 0))
        lens_d = torch.zeros(B, dtype=torch.long, device=dev).index_put_((rows_d,), keep.long())
        start_d = self.fed_d.clamp(max=cap - 1)
        if rec is not None:
            self.open_window()
        ix = self.step_ix[len(self.steps):len(self.steps) + 1] if rec is not None else None
        pred = int(self.fed[self.active[may]].max()) + 1
        wait = self.eng.to_host_async(*sampled)  # the copy goes first in the stream, the step after it
        nxt = (self.graphs(ids_d[:, None], start_d, lens_d, pred, ix), ids_d, start_d, lens_d, pred, ix)
        self.fed_d += lens_d
        return nxt, wait()

    def _stopped(self, t: int, tok: np.ndarray):
        """Which samples stop at step t and why (the general loop's order of stop reasons: stop token, stop string,
        the context, max_new_tokens). -> (fin [A]: the sample stops; (is_stop, is_str, cap_hit))."""
        active, stops = self.active, self.stops
        is_stop = np.isin(tok, self.stop)
        is_str = stops.hits(tok, active, self.out_tok[:t]) if stops is not None else np.zeros_like(is_stop)
        if self.sure_d is not None and stops.new_sure:  # small: only tokens whose text holds a stop string
            self.sure_d[torch.tensor(stops.new_sure, device=self.eng.device)] = True
        cap_hit = self.plen[active] + t + 1 >= self.cap
        fin = is_stop | is_str | cap_hit | (t + 1 >= self.max_new_tokens)
        ctx = "length" if self.cap < self.eng.max_seq_len else "context"
        for j in np.flatnonzero(fin).tolist():
            b = int(active[j])
            self.reason[b] = ("stop_token" if is_stop[j] else "stop_string" if is_str[j] else ctx if cap_hit[j]
                              else "length")
            if self.recorder is not None:
                self.tail[b] = [int(tok[j])]  # fed after generation, only so that the record holds it
        return fin, (is_stop, is_str, cap_hit)

    def _feed(self, go: np.ndarray, feed: np.ndarray, tok: np.ndarray, nxt, stopped) -> torch.Tensor:
        """Feed the samples that go on (`go`) their tokens (`feed`; tok: every active sample's): the step launched
        ahead (run again where it guessed wrong), a decode-graph step, or an eager chunk. -> the logits of the
        next step (rows: `lrow`)."""
        fed, B = self.fed, self.B
        if nxt is not None:  # launched with the rows the device kept
            logits = self._settle(go, tok, nxt, stopped)
            self.lrow = self.rows_on_device(go)
        elif self.graphs is not None:
            ids, lens = np.zeros(B, dtype=np.int64), np.zeros(B, dtype=np.int64)
            ids[go], lens[go] = feed, 1
            logits = self.decode_all(ids, lens, fed)
            self.lrow = self.rows_on_device(go)
        else:
            rows = go.tolist()
            logits = self.eng.feed(self.cache, [[x] for x in feed.tolist()], fed[go].tolist(), rows, self.recorder,
                                   rows)
            self.lrow = None  # the chunk's logits are the fed rows', in order
        fed[go] += 1
        return logits

    def _settle(self, go: np.ndarray, tok: np.ndarray, nxt, stopped) -> torch.Tensor:
        """The step launched ahead, or the same step again where the device's guess was wrong (a smaller
        attention bucket; a row a stop string stopped, which then feeds nothing)."""
        logits, ids_d, start_d, lens_d, pred, ix = nxt
        is_stop, is_str, cap_hit = stopped
        stops, graphs = self.stops, self.graphs
        exact = int(self.fed[go].max()) + 1
        again = graphs.span(exact) != graphs.span(pred)  # the general loop's bucket
        if stops is not None:  # rows the device fed that a stop string stopped: fed nothing there
            # the device dropped the rows whose token it knew as stopping: known before this step's
            # `hits`, i.e. sure now and not first seen now
            known = stops.sure[tok] & ~np.isin(tok, stops.new_sure)
            wrong = self.active[is_str & ~is_stop & ~cap_hit & ~known]
            if wrong.size:
                w = torch.as_tensor(wrong, device=self.eng.device)
                ids_d[w], lens_d[w] = 0, 0
                self.fed_d[w] -= 1
                again = True
        if again:  # the general loop's step: the same step again
            logits = graphs(ids_d[:, None], start_d, lens_d, exact, ix)
        if self.rec is not None:
            self.steps.append(dict(zip(go.tolist(), self.fed[go].tolist(), strict=True)))
        return logits

    def _result(self) -> RolloutBatch:
        B, count = self.B, self.count
        new_tok, new_lp = self.out_tok.T.tolist(), self.out_lp.T.tolist()  # [B][steps]
        logps = [new_lp[b][: count[b]] for b in range(B)]
        for b in range(B):
            self.tokens[b] += new_tok[b][: count[b]]
        trainable = [[True] * int(c) for c in count]
        return self.finish(self.fed.tolist(), logps, trainable, self.reason, int(count.sum()), [0] * B)
