"""`python -m trace.rl.calibrate --config RL.yaml --bases SFT_0 SFT_1 SFT_2 [--set rl.rho=R ...]`: the alignment
coefficient of one guided depth by the rule of DESIGN.md §3.

The rule: `rl.align_coef` at guided depth rho is the coefficient at which the alignment term's gradient norm at RL
step 1 is TARGET (0.2) times the rest of the loss's (`grad_norm_align / grad_norm_rest`, what the trainer logs
every step), the median over seeds 0, 1, 2, each from its own SFT base (`--bases`, one per seed; without it every
seed starts from the config's `rl.init_ckpt`), on the calibration family, rounded to one significant digit; then
frozen for every family, task and seed of the profile at that depth. Each depth (the `trace` arm at rho 1,
`trace-deep` at rho 0.5) has its own calibration: the same coefficient gives a ~10x smaller step-1 ratio at rho 1
than at rho 0.5, where unguided shallow layers make the guided ones disagree more with the rollout.

At step 1 the ratio is linear in the coefficient: the rollout, the batch and the loss's other parts come before
any update, `grad_norm_align` is the norm of coef * (the term's gradient) and `grad_norm_rest` that of the other
parts. So each seed runs one trainer step at one coefficient (`--coef`, any positive value) and the coefficient
is coef * TARGET / median(ratio); a last step at the chosen coefficient (seed 0) checks the linearity and
reports the ratio the frozen value gives. Nothing is written but `--out` (a JSON report, by convention
results/guidance/align_calibration_<flavor>_rho<rho>.json, the file the pipeline reads; the runs' directories are
temporary). The report is also printed.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

from trace import config as C
from trace import rundir
from trace.guidance import Method

TARGET = 0.2  # grad_norm_align / grad_norm_rest at step 1 (the rule's band: 0.1-0.3)
SEEDS = (0, 1, 2)
LOGGED = ("grad_norm_align", "grad_norm_rest", "grad_norm", "align_loss", "policy_loss", "reward_mean",
          "align_codes_share", "align_scales_share", "align_codes_flipped", "align_scales_flipped")


def round_1sig(x: float) -> float:
    """x rounded to one significant digit (0.0137 -> 0.01, 0.0151 -> 0.02, 2.6 -> 3.0)."""
    if x <= 0 or not math.isfinite(x):
        raise ValueError(f"cannot round {x!r} to one significant digit")
    # in decimal, from the shortest repr, half up: 0.15 -> 0.2 (in binary 0.15 / 0.1 is just below 1.5)
    q = Decimal(repr(x))
    e = q.adjusted()
    d = int(q.scaleb(-e).quantize(Decimal(1), rounding=ROUND_HALF_UP))
    return float(f"{d}e{e}") if d < 10 else float(f"1e{e + 1}")


def step1(cfg: dict, coef: float, seed: int, base: str | None = None) -> dict:
    """One RL step (step 1) of `cfg` at align_coef `coef` and seed `seed` (from SFT base `base`, else the config's
    rl.init_ckpt), in a temporary run directory; returns the logged values of LOGGED (None where absent) and their
    ratio."""
    from trace.rl.trainer import RLTrainer
    sets = [f"rl.align_coef={coef}", f"seed={seed}", "rl.steps=1", "rl.eval_every=0"]
    run = C.load_config(None, sets + ([f"rl.init_ckpt={base}"] if base is not None else []), base=cfg)
    with tempfile.TemporaryDirectory(prefix="calibrate_") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        rec = RLTrainer(run, Path(tmp) / "run", progress=False).step(1).to_dict()
    if rec.get("grad_norm_align") is None:
        raise C.ConfigError(f"rl.method={cfg['rl']['method']} logged no alignment gradient at step 1 "
                            f"(an arm with the alignment term is needed)")
    out = {"seed": seed, "init_ckpt": run["rl"]["init_ckpt"], "coef": coef, **{k: rec.get(k) for k in LOGGED}}
    out["ratio"] = rec["grad_norm_align"] / rec["grad_norm_rest"]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def calibrate(cfg: dict, coef: float = 0.1, seeds=SEEDS, target: float = TARGET, check: bool = True,
              bases=None) -> dict:
    """The rule's coefficient for `cfg` (an RL config of an arm with the alignment term at its guided depth
    rl.rho): a report with each seed's step-1 values (seed k from `bases[k]`, else from rl.init_ckpt), the median
    ratio per unit coefficient, the chosen coefficient and, with `check`, the first seed's step 1 at the chosen
    coefficient."""
    bases = list(bases) if bases else [None] * len(seeds)
    if len(bases) != len(seeds):
        raise C.ConfigError(f"--bases: {len(bases)} SFT bases for {len(seeds)} seeds (one per seed)")
    runs = [step1(cfg, coef, s, b) for s, b in zip(seeds, bases, strict=True)]
    per_unit = statistics.median(r["ratio"] / coef for r in runs)
    exact = target / per_unit
    chosen = round_1sig(exact)
    rep = {"rule": "DESIGN.md §3 (alignment coefficient)", "target_ratio": target, "probe_coef": coef,
           "model": cfg["model"], "task": cfg["task"]["name"], "method": cfg["rl"]["method"],
           "rho": float(Method.from_config(cfg["rl"]).rho), "init_ckpt": [r["init_ckpt"] for r in runs],
           "commit": rundir.git_commit(), "runs": runs,
           "ratio_per_unit_coef_median": per_unit, "coef_exact": exact, "align_coef": chosen,
           "ratio_at_align_coef_predicted": per_unit * chosen}
    if check:
        chk = step1(cfg, chosen, seeds[0], bases[0])
        first = runs[0]
        rep["check"] = {**chk, "linearity_rel_err": abs(chk["ratio"] / chosen - first["ratio"] / coef)
                        / (first["ratio"] / coef)}
    return rep


def main(argv=None) -> int:
    p = C.base_parser("python -m trace.rl.calibrate",
                      "The alignment coefficient of one guided depth by the rule of DESIGN.md §3: step-1 "
                      "gradient ratio 0.2.")
    p.add_argument("--coef", type=float, default=0.1, help="probe coefficient (the ratio is linear in it)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="seeds whose median ratio counts")
    p.add_argument("--bases", nargs="+", help="each seed's SFT base (run dir or ckpt), in the order of --seeds")
    p.add_argument("--target", type=float, default=TARGET, help=argparse.SUPPRESS)
    p.add_argument("--no-check", action="store_true", help="skip the step at the chosen coefficient")
    p.add_argument("--out", help="write the JSON report here too")
    a, cfg = C.parse_cli(p, argv)
    try:
        rep = calibrate(cfg, a.coef, a.seeds, a.target, check=not a.no_check, bases=a.bases)
    except C.ConfigError as e:
        C.fail(e)
    rep["command"] = "python -m trace.rl.calibrate " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(rep, indent=1)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
