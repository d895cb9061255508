"""Micro-batches of the embedded RL trainer's step: the step's sequences in chunks of `rl.micro_batch`, one
forward and backward each, gradients accumulated, one optimizer step, with the loss and gradient of the
whole-batch step (DESIGN.md §4 "Micro-batches").

    out = micro_step(trainer, tb, adv, record, diag, size, split)

What is split and what is normalized over the whole batch:
- advantages: computed over the whole batch before splitting (group_norm / rloo groups and
  reinforce_baseline's whitening see every sequence); each chunk takes its rows.
- policy loss and KL: token means over the whole batch's trainable tokens. Each chunk's token mean
  (`RLTrainer._loss` on the chunk) is weighted by its share of those tokens, so the weighted sum is the
  whole-batch mean; the logged policy_loss, kl_ref, clip_frac and is_filter_frac merge the same way.
- TRACE's record: each chunk's forward replays with its own (seq, pos) rows (the record is looked up by
  sequence and position), so guided rounding and routing replay are the whole-batch forward's per row.
- alignment term: the mean hinge over ALL guided items of the step. A chunk's items are its valid token rows
  times the guided items per token row (every guided site quantizes every valid row), so the step's total
  is predicted from the first chunk and each chunk adds sum_of_hinges / total; after the last chunk the
  summed item counts must equal the prediction (else RuntimeError, nothing applied). On split steps
  (every step of an arm with the term) its gradient is accumulated apart for grad_norm_align / grad_norm_rest.
- replay statistics (flips, alignment parts): counts summed over the chunks (`ReplayStats.merge`), so
  rates are whole-batch rates; mismatch metrics are computed by the caller from the assembled log-probs.
- the exact arm: not split (the config refuses micro_batch for it; its chunked engine scoring is unverified).
Each chunk's graph is freed by its backward before the next chunk's forward: the step's activation peak is
one chunk's. Compared against: tests/rl/test_micro_batch.py (gradients and metrics of the whole-batch step).
"""
from __future__ import annotations

import time
from dataclasses import fields

import torch

from trace.rl.losses import NonFiniteError


def chunks(n: int, size: int) -> list[range]:
    """Row ranges of `size` sequences (the last one shorter when size does not divide n)."""
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def sub_batch(tb, rows: range):
    """The train batch's rows `rows`, its columns cut to the chunk's longest input (padding is on the right)."""
    sl = slice(rows.start, rows.stop)
    T = int(tb.att[sl].sum(1).max())
    return type(tb)(**{f.name: getattr(tb, f.name)[sl] if f.name == "seq" else getattr(tb, f.name)[sl, :T]
                       for f in fields(tb)})


def _merge_parts(acc: dict, parts: dict, w: float) -> None:
    """acc += w * parts for the token means (policy_loss, kl_ref, clip_frac, is_filter_frac; None stays None)."""
    for k in ("policy_loss", "kl_ref", "clip_frac", "is_filter_frac"):
        v = parts.get(k)
        if v is not None:
            acc[k] = (acc.get(k) or 0.0) + w * v
        else:
            acc.setdefault(k, None)


def split_grad(part: torch.Tensor, params: list) -> tuple[tuple, float]:
    """The gradient of `part` (a term of the step's loss) alone, the graph kept for the loss's backward, and the
    seconds it took (the device drained before and after, so the time is this backward's): what
    grad_norm_align / grad_norm_rest cost, a diagnostic that the step's logged times leave out."""
    cuda = part.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(part.device)
    t0 = time.perf_counter()
    g = torch.autograd.grad(part, params, retain_graph=True, allow_unused=True)
    if cuda:
        torch.cuda.synchronize(part.device)
    return g, time.perf_counter() - t0


def micro_step(tr, tb, adv: torch.Tensor, record, diag, size: int, split: bool):
    """One RL step's forwards and backwards in chunks of `size` sequences, gradients accumulated into the
    model's .grad (zeroed first), then clipped and applied (`RLTrainer._apply`). tb, adv: the whole batch and
    its advantages. Returns (log-probs [B, T] detached, merged ReplayStats or None, the loss (0-d, detached),
    its logged parts, gradient norm, split norms)."""
    method = tr.method
    if method.exact:
        raise ValueError("the exact arm takes no micro-batches (config key 'rl.micro_batch')")
    n_tok = int(tb.mask.sum())
    n_valid = int(tb.att.sum())
    lp_all = torch.zeros(tb.ids.shape, dtype=torch.float32, device=tb.ids.device)
    params = [p for p in tr.model.parameters() if p.requires_grad]
    g_align = None  # the alignment term's accumulated gradient (split steps)
    merged, per_row, items, loss_sum, t_split = None, None, 0, 0.0, 0.0
    parts: dict = {"align_loss": None}
    tr.opt.zero_grad(set_to_none=True)
    try:
        for rows in chunks(tb.ids.shape[0], size):
            sub = sub_batch(tb, rows)
            a = adv[rows.start: rows.stop, : sub.ids.shape[1]]
            lp, stats = tr._replayed_logprobs(sub, record, diag)
            lp_all[rows.start: rows.stop, : lp.shape[1]] = lp.detach()
            w = int(sub.mask.sum()) / n_tok
            loss, p, _ = tr._loss(lp, sub, a, None)  # token means over the chunk: policy loss (+ KL)
            _merge_parts(parts, p, w)
            loss = loss * w
            part = None
            al = method.alignment(stats)
            if al is not None and al.weighted is not None:
                count = int(stats.align_count)
                if per_row is None:
                    per_row, rem = divmod(count, int(sub.att.sum()))
                    if rem:
                        raise RuntimeError(f"alignment items per token row not whole ({count} items over "
                                           f"{int(sub.att.sum())} rows): micro-batches cannot normalize the term")
                part = al.weighted * (count / (per_row * n_valid))  # align_coef * hinge sum / whole-batch items
            if stats is not None:
                items += int(stats.align_count)
                merged = stats.merge(merged)
            if part is not None and split:
                g, t = split_grad(part, params)
                t_split += t
                if g_align is None:
                    g_align = [torch.zeros_like(q) for q in params]
                for acc, gi in zip(g_align, g, strict=True):
                    if gi is not None:
                        acc.add_(gi)
            total = loss if part is None else loss + part.to(loss.device)
            if not bool(torch.isfinite(total)):
                raise NonFiniteError(f"non-finite loss ({float(total)})")
            tr._backward(total)
            loss_sum += float(total.detach())
            del lp, loss, part, total, al, stats  # this chunk's graph is gone before the next forward
        if per_row is not None and items != per_row * n_valid:
            raise RuntimeError(f"alignment items: the chunks had {items}, the prediction from the first chunk was "
                               f"{per_row * n_valid}; the step's gradient would be wrong")
    except BaseException:
        tr.opt.zero_grad(set_to_none=True)
        raise
    al = method.alignment(merged)
    if al is not None:
        parts["align_loss"] = float(al.term)
        parts.update(al.parts)
    norms = {}
    if g_align is not None:
        sq = lambda ts: float(sum((t.float() ** 2).sum() for t in ts) ** 0.5)  # noqa: E731
        norms = {"grad_norm_align": sq(g_align),
                 "grad_norm_rest": sq([q.grad - g for q, g in zip(params, g_align, strict=True)
                                       if q.grad is not None]), "time_split_s": t_split}
    gn = tr._apply()
    return lp_all, merged, torch.tensor(loss_sum), parts, gn, norms


__all__ = ["chunks", "micro_step", "split_grad", "sub_batch"]
