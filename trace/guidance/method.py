"""An arm's method, one object for every trainer: what the rollout records, the replay around the
trainer's forward, the weighted alignment term and the byte accounting of the arm's record.

The embedded RL trainer (trace/rl/trainer.py) and the OpenRLHF actors (trace/integrations/openrlhf:
the rollout actor records, the policy actor replays) hold a `Method` built from the run config and
call only its API, so a new setting of the method (a knob of the replay or of the alignment term) is
read here, declared in the config schema, and implemented in trace/guidance: no trainer changes.

    method = Method.from_config(cfg["rl"])
    guide, diag = method.recorders(num_layers)               # rollout: the arm's recorders (or None)
    record, diag = guide.finish(), diag.finish()
    with method.replay(rt, record, diag, seq, pos) as stats:  # trainer forward, open across backward
        loss = ...
        al = method.alignment(stats)                          # None where the arm has no term
        if al is not None:
            loss = al.add_to(loss)                            # + align_coef * term

`rt` is the patched model's guidance runtime (`trace.qat.runtime(model)`, or what `patch_model`
returned). The embedded trainer also takes from the method how the rollout engine is built
(`engine_kwargs`), how the trainer's log-probs are made (`logprobs`: a plain forward, the forward inside the
replay, or the exact arm's values from the engine's batch-invariant scoring with the gradient of a pinned
forward), the mismatch metrics of those log-probs (`mismatch`) and the alignment term's normalization over a
step's micro-batches (`step_alignment`). DESIGN.md §3 (the method) and §4 (the arms).
Compared against: tests/guidance/test_method.py (the calls the trainers made before, argument for argument).
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trace.arms import ARMS, Arm
from trace.guidance.mismatch import mismatch_metrics
from trace.guidance.replay import replay as _replay
from trace.guidance.select import arm_recorders, arm_records
from trace.settings import RLSettings


@dataclass(frozen=True)
class Alignment:
    """The alignment term of one trainer forward. `term` is the unweighted term (a 0-d tensor), `weighted`
    the part added to the loss (align_coef * term; None where the coefficient is 0 or the term carries no
    gradient, e.g. a forward without flips), `parts` the term's logged parts (`ReplayStats.alignment_parts`:
    element vs block-scale hinge and share, and per layer)."""

    term: torch.Tensor
    weighted: torch.Tensor | None
    parts: dict

    def add_to(self, loss: torch.Tensor) -> torch.Tensor:
        """loss + the weighted term (on the loss's device); the loss itself where nothing is weighted in."""
        return loss if self.weighted is None else loss + self.weighted.to(loss.device)


@dataclass(frozen=True)
class TrainerLogprobs:
    """The trainer's log-probs of one (micro-)batch, as the arm makes them (`Method.logprobs`)."""

    lp: torch.Tensor  # [B, T] what the loss reads: its values and its gradient
    stats: object | None  # the replay's ReplayStats (None without a record)
    grad_lp: torch.Tensor | None  # [B, T] detached: the differentiated forward's own values where lp's values are
    # not its own (the exact arm), else None
    engine_s: float | None  # seconds of the engine's scoring forward (the exact arm), else None


class StepAlignment:
    """The alignment term of one train step whose forward runs in chunks of its sequences (trace/rl/trainstep.py):
    the mean hinge over ALL the step's guided items. A chunk adds its hinge sum over the step's item count (its own
    term, align_coef * sum / own items, scaled by own items / the step's). A chunk's items are its valid token
    rows times the guided items per row (every guided site quantizes every valid row), so the step's count is
    predicted from the first chunk with a term; `check` compares it with the chunks' sum at the end. A chunk
    holding all the step's rows adds its own weighted term unscaled."""

    def __init__(self, method: Method, rows: int):
        self.method, self.rows = method, rows  # rows: the step's valid token rows
        self.per_row: int | None = None  # guided items per valid row, from the first chunk with a term
        self.items = 0  # the chunks' guided items

    def part(self, stats, rows: int) -> torch.Tensor | None:
        """The weighted part of the step's term that a chunk of `rows` valid token rows adds to its loss (None
        where it adds nothing); stats: the chunk's ReplayStats (None without a replay)."""
        if stats is None or not self.method.aligns:
            return None
        count = int(stats.align_count)
        self.items += count
        weighted = self.method.weighted(stats.alignment_loss())
        if weighted is None:
            return None
        if rows == self.rows:  # the whole step in one chunk: its items are the step's
            return weighted
        if self.per_row is None:
            self.per_row, rem = divmod(count, rows)
            if rem:
                raise RuntimeError(f"alignment items per token row not whole ({count} items over {rows} rows): "
                                   "micro-batches cannot normalize the term")
        return weighted * (count / (self.per_row * self.rows))  # align_coef * hinge sum / the step's items

    def check(self) -> None:
        """After the last chunk: the chunks' items must be the predicted count (else the gradient is wrong)."""
        if self.per_row is not None and self.items != self.per_row * self.rows:
            raise RuntimeError(f"alignment items: the chunks had {self.items}, the prediction from the first chunk "
                               f"was {self.per_row * self.rows}; the step's gradient would be wrong")


@dataclass(frozen=True)
class Method:
    """The trainer-side method of one arm (`trace.arms.ARMS[name]`) under one run's settings."""

    name: str
    arm: Arm
    # the run's rl.rho, rl.diag_flips, rl.align_coef and rl.align_scales; their defaults are the settings'
    rho: float = RLSettings.rho
    diag_flips: bool = RLSettings.diag_flips
    align_coef: float = RLSettings.align_coef
    align_scales: bool = RLSettings.align_scales

    @classmethod
    def from_config(cls, rl: dict) -> Method:
        """From a run config's `rl` section (validated by trace.config: every key present)."""
        return cls(name=rl["method"], arm=ARMS[rl["method"]], rho=rl["rho"], diag_flips=rl["diag_flips"],
                   align_coef=rl["align_coef"], align_scales=rl["align_scales"])

    # ---------------------------------------------------------------- rollout: what to record
    def records(self) -> tuple[bool, bool]:
        """(whether the rollout takes the arm's guidance record, whether it takes the diagnostic record)."""
        return arm_records(self.arm, self.diag_flips)

    def recorders(self, num_layers: int):
        """(guidance recorder, diagnostic recorder) for one rollout, each None where the arm takes none."""
        return arm_recorders(self.arm, num_layers, self.rho, self.diag_flips)

    @property
    def exact(self) -> bool:
        """Whether the arm is exact on-policy: a batch-invariant rollout engine (`RolloutEngine(batch_invariant=True)`)
        and the trainer's log-prob values from the engine's own forward over the rollout's tokens, no record, no
        alignment term, zero guidance bytes (DESIGN.md §4 "Exact on-policy arm")."""
        return self.arm.exact

    def engine_kwargs(self) -> dict:
        """The rollout engine's arguments that the arm decides: `RolloutEngine(config, fmt=, device=, **these)`."""
        return {"mode": self.arm.engine_mode, "kv_fp4": self.arm.kv_fp4, "batch_invariant": self.arm.exact}

    def device_problem(self, device: str) -> str | None:
        """Why the arm cannot run on `device` in this process (None where it can): the exact arm's engine runs the
        Triton kernels, on a CPU only in the interpreter (TRITON_INTERPRET=1, set before start-up)."""
        if self.arm.exact and torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return (f"the {self.name} arm on a CPU runs the Triton kernels in the interpreter; set TRITON_INTERPRET=1 "
                    "before starting (or run on a GPU)")
        return None

    @property
    def logprobs_from_engine(self) -> bool:
        """Whether the trainer's log-prob values come from the rollout engine's scoring (the exact arm), which a
        trainer whose log-probs are its own forward's (OpenRLHF's experience maker) cannot express."""
        return self.arm.exact

    def record_bytes_per_generated_token(self, record, n_generated: int) -> float:
        """DESIGN.md §3 bytes of the arm's own record per generated token (full codes only where the arm guides
        with them; 0.0 without a record)."""
        if record is None:
            return 0.0
        return record.bytes_per_generated_token(n_generated, compact_only=not self.arm.full_codes)

    def record_bits_per_element(self, record) -> float | None:
        """Bits of the record's activation sites per guided element (None without a record)."""
        return record.bits_per_element(compact_only=not self.arm.full_codes) if record is not None else None

    # ---------------------------------------------------------------- trainer: log-probs, replay and alignment
    def logprobs(self, forward: Callable[[], torch.Tensor], rt, record, diag, seq: torch.Tensor, pos: torch.Tensor,
                 valid: torch.Tensor, score: Callable[[], tuple] | None = None) -> TrainerLogprobs:
        """The trainer's log-probs of one (micro-)batch as the arm makes them. forward(): the trainer's forward in its
        mode, log-probs [B, T]; valid [B, T]: real tokens; score(): the exact arm's (values [B, T], context pinning
        each layer's input to the engine's residual stream), the engine's batch-invariant forward over the rollout's
        tokens (`RolloutEngine.score` on the kernels the rollout sampled with).
        - exact: values from score(), equal to the rollout's log-probs bit for bit; gradient of forward() run with
          the inputs pinned: v + (g - g.detach()) is v exactly (g - g.detach() is 0 for a finite g) with g's gradient
          (DESIGN.md §4 "Exact on-policy arm"); no record, no replay.
        - every other arm: forward() inside `replay` (a plain forward where there is no record)."""
        if self.arm.exact:
            t0 = time.perf_counter()
            v, pinned = score()
            t_engine = time.perf_counter() - t0
            with pinned:
                lp = forward()
            g = torch.where(valid, lp - lp.detach(), torch.zeros_like(lp))
            return TrainerLogprobs(v.to(lp.device) + g, None, lp.detach(), t_engine)
        with self.replay(rt, record, diag, seq, pos) as stats:
            lp = forward()
        return TrainerLogprobs(lp, stats, None, None)

    def mismatch(self, lp: torch.Tensor, grad_lp: torch.Tensor | None, lp_roll: torch.Tensor,
                 mask: torch.Tensor) -> dict:
        """The mismatch metrics (trace.guidance.mismatch) of the trainer's log-probs `lp` (detached) against the
        rollout's over `mask`; with `grad_lp` (`TrainerLogprobs.grad_lp`) also `k3_grad`, the k3 of the function
        whose gradient the step takes."""
        mm = mismatch_metrics(lp, lp_roll, mask)
        if grad_lp is not None:
            mm["k3_grad"] = mismatch_metrics(grad_lp, lp_roll, mask)["k3"]
        return mm

    def replay(self, rt, record, diag, seq: torch.Tensor, pos: torch.Tensor):
        """The context around the trainer forward (and its backward): `trace.guidance.replay` on runtime `rt`
        with the arm's guidance record (guided rounding, routing replay, alignment term) and the diagnostic
        record (flip statistics); yields their ReplayStats, or None where there is neither record."""
        if record is None and diag is None:
            return contextlib.nullcontext(None)
        arm = self.arm
        return _replay(rt, record, seq, pos, routing=arm.routing, align=arm.align, full_codes=arm.full_codes,
                       diag=diag, align_scales=self.align_scales)

    @property
    def aligns(self) -> bool:
        """Whether the arm's loss has the alignment term (it guides, with the term on)."""
        return self.arm.record == "guide" and self.arm.align

    def alignment(self, stats) -> Alignment | None:
        """The alignment term of the forward whose ReplayStats are `stats`; None where the arm has no term
        or there was no replay."""
        if stats is None or not self.aligns:
            return None
        term = stats.alignment_loss()
        return Alignment(term, self.weighted(term), stats.alignment_parts())

    def weighted(self, term: torch.Tensor) -> torch.Tensor | None:
        """align_coef * term, the part added to the loss; None where the coefficient is 0 or the term carries no
        gradient (a forward without flips)."""
        return self.align_coef * term if self.align_coef > 0 and term.requires_grad else None

    def step_alignment(self, rows: int) -> StepAlignment:
        """The alignment term's normalization over a train step of `rows` valid token rows run in chunks."""
        return StepAlignment(self, rows)


__all__ = ["Alignment", "Method", "StepAlignment", "TrainerLogprobs"]
