"""The embedded RL trainer's train step: forwards, losses, backwards and one optimizer step over a train batch, in
chunks of `rl.micro_batch` sequences with gradients accumulated; the whole batch is one chunk (DESIGN.md §4
"Micro-batches", §5 "The train step").

    step = TrainStep(model, opt, method, grad_clip=1.0, micro_batch=0)
    res = step.run(tb, adv, forward, loss)        # StepResult: log-probs, replay statistics, loss, parts, norms

`forward(sub, rows)` gives the trainer's log-probs of rows `rows` of the batch (`sub`: those rows) as the arm's
`Method.logprobs` makes them; `loss(lp, sub, adv)` the chunk's policy loss (+ KL) as token means over the chunk
and its logged parts. What is split and what is normalized over the whole batch:
- advantages: computed over the whole batch before splitting (group_norm / rloo groups and
  reinforce_baseline's whitening see every sequence); each chunk takes its rows.
- policy loss and KL: token means over the whole batch's trainable tokens. Each chunk's token mean is weighted by
  its share of those tokens (1 for the whole batch), so the weighted sum is the whole-batch mean; the logged
  policy_loss, kl_ref, clip_frac and is_filter_frac merge the same way.
- TRACE's record: each chunk's forward replays with its own (seq, pos) rows (the record is looked up by sequence and
  position), so guided rounding and routing replay are the whole-batch forward's per row.
- alignment term: the mean hinge over ALL guided items of the step (`Method.step_alignment`, trace/guidance). Its
  gradient is accumulated apart as well, for grad_norm_align / grad_norm_rest (a diagnostic backward on every step
  that has the term, whose seconds go to time_split_s and out of the step's other times).
- replay statistics (flips, alignment parts): counts summed over the chunks (`ReplayStats.merge`), so rates are
  whole-batch rates; the log-probs are assembled into [B, T] for the mismatch metrics.
- the logged loss: the chunks' weighted totals summed in double and rounded to float32, the whole batch's own value
  when it is one chunk.
- the exact arm: the config refuses micro-batches for it (its chunked engine scoring is unverified).
Each chunk's graph is freed by its backward before the next chunk's forward: the step's activation peak is one
chunk's. Any failure before the optimizer step (non-finite loss or gradient norm) zeroes the gradients and applies
nothing. Compared against: tests/rl/test_trainstep.py (micro-batches give the gradients and metrics of the
whole-batch step).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from trace.rl.losses import NonFiniteError
from trace.settings import RLSettings


def chunks(n: int, size: int) -> list[range]:
    """Row ranges of `size` sequences (the last one shorter when size does not divide n)."""
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def sub_batch(tb, rows: range):
    """The train batch's rows `rows`, its columns cut to the chunk's longest input (padding is on the right)."""
    sl = slice(rows.start, rows.stop)
    T = int(tb.att[sl].sum(1).max())
    return type(tb)(**{f.name: getattr(tb, f.name)[sl] if f.name == "seq" else getattr(tb, f.name)[sl, :T]
                       for f in fields(tb)})


def grad_norm(grads) -> float:
    """The L2 norm over a list of gradient tensors (None entries skipped)."""
    return float(sum((g.float() ** 2).sum() for g in grads if g is not None) ** 0.5)


def split_grad(part: torch.Tensor, params: list) -> tuple[tuple, float]:
    """The gradient of `part` (a term of the step's loss) alone, the graph kept for the loss's backward, and the
    seconds it took (the device drained before and after, so the time is this backward's)."""
    cuda = part.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(part.device)
    t0 = time.perf_counter()
    g = torch.autograd.grad(part, params, retain_graph=True, allow_unused=True)
    if cuda:
        torch.cuda.synchronize(part.device)
    return g, time.perf_counter() - t0


@dataclass
class StepResult:
    """What one train step hands to the step's metrics."""

    lp: torch.Tensor  # [B, T] the loss's log-prob values, detached (0 past each row's inputs)
    grad_lp: torch.Tensor | None  # [B, T] the differentiated forward's own values where they are not lp's (exact arm)
    stats: object | None  # ReplayStats over the whole batch (None without a record)
    loss: float  # the optimized loss: policy loss (+ KL) (+ the weighted alignment term)
    parts: dict  # policy_loss, kl_ref, clip_frac, is_filter_frac, align_loss and the alignment term's parts
    grad_norm: float  # before clipping
    grad_norm_align: float | None  # the weighted alignment term's gradient alone (None without the term)
    grad_norm_rest: float | None  # the rest of the loss's gradient (None without the term)
    split_s: float  # seconds of the alignment term's separate backward
    engine_s: float | None  # seconds of the engine's scoring forwards (exact arm), else None


def _merge_parts(acc: dict, parts: dict, w: float) -> None:
    """acc += w * parts for the token means (policy_loss, kl_ref, clip_frac, is_filter_frac; None stays None); the
    first chunk's w * value starts the sum."""
    for k in ("policy_loss", "kl_ref", "clip_frac", "is_filter_frac"):
        v = parts.get(k)
        if v is None:
            acc.setdefault(k, None)
        else:
            acc[k] = w * v if acc.get(k) is None else acc[k] + w * v


class TrainStep:
    """The train step of one trainer: its model's parameters, optimizer, the arm's Method, gradient clipping and
    micro-batch size (0, or at least the batch: one chunk)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, method, grad_clip: float,
                 micro_batch: int | None = RLSettings.micro_batch):
        self.model, self.opt, self.method = model, opt, method
        self.grad_clip, self.micro_batch = grad_clip, micro_batch or 0

    def run(self, tb, adv: torch.Tensor, forward: Callable, loss: Callable) -> StepResult:
        """One step over train batch `tb` with advantages `adv` [B, T]: gradients zeroed, each chunk's forward, loss
        and backward, then clipping and the optimizer step (`apply`)."""
        method = self.method
        B = tb.ids.shape[0]
        size = self.micro_batch if 0 < self.micro_batch < B else B
        n_tok = int(tb.mask.sum())
        align = method.step_alignment(int(tb.att.sum()))
        lp_all = torch.zeros(tb.ids.shape, dtype=torch.float32, device=tb.ids.device)
        g_all = None
        params = [p for p in self.model.parameters() if p.requires_grad]
        g_align = None  # the alignment term's accumulated gradient, per parameter
        merged, loss_sum, t_split, engine_s = None, None, 0.0, None
        parts: dict = {}
        self.opt.zero_grad(set_to_none=True)
        try:
            for rows in chunks(B, size):
                sub = sub_batch(tb, rows)
                out = forward(sub, rows)
                lp = out.lp
                lp_all[rows.start: rows.stop, : lp.shape[1]] = lp.detach()
                if out.grad_lp is not None:
                    if g_all is None:
                        g_all = torch.zeros_like(lp_all)
                    g_all[rows.start: rows.stop, : lp.shape[1]] = out.grad_lp
                if out.engine_s is not None:
                    engine_s = (engine_s or 0.0) + out.engine_s
                w = int(sub.mask.sum()) / n_tok
                chunk_loss, p = loss(lp, sub, adv[rows.start: rows.stop, : sub.ids.shape[1]])
                _merge_parts(parts, p, w)
                part = align.part(out.stats, int(sub.att.sum()))
                if out.stats is not None:
                    merged = out.stats if merged is None else out.stats.merge(merged)
                if part is not None:  # the term's gradient apart, for grad_norm_align / grad_norm_rest
                    g, t = split_grad(part, params)
                    t_split += t
                    g_align = list(g) if g_align is None else [
                        a if b is None else b if a is None else a + b for a, b in zip(g_align, g, strict=True)]
                total = chunk_loss * w
                if part is not None:
                    total = total + part.to(total.device)
                if not bool(torch.isfinite(total)):
                    raise NonFiniteError(f"non-finite loss ({float(total.detach())})")
                self.backward(total)
                v = float(total.detach())
                loss_sum = v if loss_sum is None else loss_sum + v
                del out, lp, chunk_loss, part, total  # this chunk's graph is gone before the next forward
            align.check()
            al = method.alignment(merged)
            parts["align_loss"] = float(al.term.detach()) if al is not None else None
            if al is not None:
                parts.update(al.parts)
            norm_align = norm_rest = None
            if g_align is not None:
                norm_align = grad_norm(g_align)
                norm_rest = grad_norm([q.grad - g if g is not None else q.grad
                                       for q, g in zip(params, g_align, strict=True) if q.grad is not None])
            gn = self.apply()
        except BaseException:
            self.opt.zero_grad(set_to_none=True)
            raise
        return StepResult(lp_all, g_all, merged, float(torch.tensor(loss_sum, dtype=torch.float32)), parts,
                          float(gn), norm_align, norm_rest, t_split, engine_s)

    def backward(self, total: torch.Tensor) -> None:
        """One chunk's backward, its gradient added to .grad."""
        total.backward()

    def apply(self) -> torch.Tensor:
        """Gradient clipping and the optimizer step on the gradient in .grad; returns the norm before clipping."""
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        if not bool(torch.isfinite(gn)):
            raise NonFiniteError(f"non-finite gradient norm ({float(gn)})")
        self.opt.step()
        return gn


__all__ = ["StepResult", "TrainStep", "chunks", "grad_norm", "split_grad", "sub_batch"]
