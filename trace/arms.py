"""The method arms of the experiments (DESIGN.md §4), defined once.

Every place that lists arms reads this table: the config schema (`rl.method`), the RL trainer (what
each arm rolls out, records and trains), the pipeline's run plan (workflow/scripts/runplan.py) and
the analysis tables (analysis/runs.py). Pure Python, no third-party imports, so the pipeline and the
analysis can import it without torch.

    from trace.arms import ARMS, MAIN_METHODS
    ARMS["trace"].trainer_mode   # "w4a4kv4"

`posthoc-fp4` is not an arm that trains: it is the FP4-deployment evaluation of the `bf16` run.
`exact` (beyond the paper, DESIGN.md §4 "Exact on-policy arm") rolls out on the engine's batch-invariant kernels and
takes the trainer's log-probs from the same kernels over the rollout's tokens: no record, no alignment term, and the
trainer's log-probs are the rollout's bit for bit (k3 = 0).
Compared against: tests/test_arms.py (the schema, trainer and pipeline agree with this table).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arm:
    engine_mode: str  # rollout engine: "bf16" | "w4a4"
    kv_fp4: bool  # FP4 KV cache in the engine
    trainer_mode: str  # trace.qat.patch_model mode of the trainer forward
    record: str | None  # None | "guide" (TRACE guidance) | "diag" (no guidance; the trainer's flip diagnostic
    # record, which every arm whose trainer quantizes activations gets, is all it records)
    full_codes: bool = False  # record (and, for "guide", replay) the full 4-bit codes
    routing: bool = False  # routing replay
    align: bool = False  # alignment term
    main: bool = False  # an arm of the main table (the others are ablations)
    exact: bool = False  # batch-invariant engine; the trainer's log-prob values from its kernels (trainer_mode: the
    # QAT forward whose straight-through backward gives the gradient)

    @property
    def deploy(self) -> str:
        """The evaluation deployment matching the rollout: "bf16" or "fp4"."""
        return "bf16" if self.engine_mode == "bf16" else "fp4"

    def setting_error(self, rl: dict) -> tuple[str, str] | None:
        """(config key, why) for the first setting of a run's `rl` section this arm cannot run with, or None. The exact
        arm runs the batch-invariant NVFP4 kernels and scores the whole batch in one engine call."""
        if self.exact and rl.get("micro_batch"):
            return "rl.micro_batch", ("not supported for the exact arm yet (its chunked engine scoring is unverified); "
                                      "leave it unset")
        if self.exact and rl["fmt"] != "nvfp4":
            return "rl.fmt", f"the exact arm runs the batch-invariant NVFP4 kernels; got {rl['fmt']!r}"
        return None

    @property
    def guidance(self) -> str:
        """What the rollout sends the trainer: "none", "mantissa+scale" or "full codes"."""
        if self.record != "guide":
            return "none"
        return "full codes" if self.full_codes else "mantissa+scale"


ARMS: dict[str, Arm] = {
    "bf16": Arm("bf16", False, "bf16", None, main=True),
    "fp4-naive": Arm("w4a4", True, "bf16", None, main=True),
    "qat-independent": Arm("w4a4", True, "w4a4kv4", "diag", full_codes=True, main=True),
    "qat-weight-only": Arm("w4a4", True, "w4a16", None, main=True),
    "trace": Arm("w4a4", True, "w4a4kv4", "guide", routing=True, align=True, main=True),
    "trace-fullcodes": Arm("w4a4", True, "w4a4kv4", "guide", full_codes=True, routing=True, align=True),
    "trace-noalign": Arm("w4a4", True, "w4a4kv4", "guide", routing=True, align=False),
    "trace-noroutingreplay": Arm("w4a4", True, "w4a4kv4", "guide", routing=False, align=True),
    "exact": Arm("w4a4", True, "w4a4kv4", None, exact=True),
}
METHODS: tuple[str, ...] = tuple(ARMS)
MAIN_METHODS: tuple[str, ...] = tuple(m for m, a in ARMS.items() if a.main)
POSTHOC = "posthoc-fp4"  # the FP4 evaluation of the bf16 run, a row of the main table
