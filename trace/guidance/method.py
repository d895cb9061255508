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
returned). DESIGN.md §3 (the method) and §4 (the arms).
Compared against: tests/guidance/test_method.py (the calls the trainers made before, argument for argument).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from trace.arms import ARMS, Arm
from trace.guidance.replay import replay as _replay
from trace.guidance.select import arm_recorders, arm_records


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
class Method:
    """The trainer-side method of one arm (`trace.arms.ARMS[name]`) under one run's settings."""

    name: str
    arm: Arm
    rho: float = 0.5  # guided fraction of the layers (the deepest)
    diag_flips: bool = True  # the diagnostic full-codes record for flip statistics
    align_coef: float = 0.1  # weight of the alignment term in the loss
    align_scales: bool = True  # the block-scale part of the alignment term

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

    def record_bytes_per_generated_token(self, record, n_generated: int) -> float:
        """DESIGN.md §3 bytes of the arm's own record per generated token (full codes only where the arm guides
        with them; 0.0 without a record)."""
        if record is None:
            return 0.0
        return record.bytes_per_generated_token(n_generated, compact_only=not self.arm.full_codes)

    def record_bits_per_element(self, record) -> float | None:
        """Bits of the record's activation sites per guided element (None without a record)."""
        return record.bits_per_element(compact_only=not self.arm.full_codes) if record is not None else None

    # ---------------------------------------------------------------- trainer: replay and alignment
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
        parts = stats.alignment_parts()
        weighted = self.align_coef * term if self.align_coef > 0 and term.requires_grad else None
        return Alignment(term, weighted, parts)


__all__ = ["Alignment", "Method"]
