"""Expand a pipeline profile (experiments/profiles/*.yaml) into the list of runs and their configs.

Used by the Snakefile (workflow/rules/common.smk) and by the tests; pure Python, no Snakemake import.
A run is (model, task, arm, seed). An *arm* is a method (one of trace/arms.py: bf16, fp4-naive,
qat-independent, qat-weight-only, trace, ...) or a named ablation variant (e.g. ``trace-rho0.5`` = method trace with
``rl.rho: 0.5``). ``posthoc-fp4`` is not a run: it is the FP4-deployment evaluation of the ``bf16`` run,
derived in analysis/tables.py.

Generated run configs use exactly the keys of the trainer's config contract (trace/config.py):
model, task{name, difficulty, n_train, n_test, seed, ...}, sft{...}, rl{method, init_ckpt, ...},
seed, device, wandb{mode}. One such YAML file is a complete single experiment:
``python -m trace.rl --config results/runs/smoke/configs/<model>/<task>/<arm>-seed<k>.yaml --out DIR``.
A profile whose RL launcher is the OpenRLHF launch may add `train_ppo_ray` flags (``openrlhf_flags``, a list of
strings, each split like a shell command line): the rl rule passes them after ``--`` (``Plan.rl_passthrough``).

    python workflow/scripts/runplan.py experiments/profiles/smoke.yaml     # print the run list
    python workflow/scripts/runplan.py experiments/profiles/small.yaml --targets mixtral-small reasoning
        # the files that finish one model's (and task's) part of the profile: Snakemake targets
"""
from __future__ import annotations

import copy
import itertools
import json
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # the repo root: the arm table lives in the trainer's package
    sys.path.insert(0, _ROOT)
from trace.arms import ARMS, METHODS  # noqa: E402
from trace.config import DEFAULTS, deep_merge  # noqa: E402  (one merge: task.knobs replaced whole)

DATA_SEED = 0  # the task data (train/test splits) is shared by every arm and seed
OPENRLHF_LAUNCH = "trace.integrations.openrlhf.launch"  # the RL launcher that takes train_ppo_ray flags after `--`


class CalibrationMissing(ValueError):
    """A run of an arm with the alignment term whose calibration file (DESIGN.md §3 rule) does not exist."""


@dataclass(frozen=True)
class Run:
    model: str
    task: str
    arm: str
    seed: int
    method: str
    ablation: bool

    @property
    def key(self) -> str:
        return f"{self.model}/{self.task}/{self.arm}/seed{self.seed}"


def set_dotted(cfg: dict, dotted: str, value: Any) -> None:
    """``set_dotted(cfg, "rl.rho", 0.5)`` sets cfg["rl"]["rho"] (creating dicts on the way)."""
    node = cfg
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"cannot set {dotted!r}: {p!r} is not a mapping")
    node[parts[-1]] = copy.deepcopy(value)


# Snakemake priority of the evaluations (rules eval, eval_base): above every RL run, so a finished run is
# evaluated before another run takes its GPU slot. A run whose evaluation has not run when the GPU machine goes
# away is lost with the machine's checkpoint (scripts/gpu/unpack_chunk.sh leaves it out). The SFT rule's is 100.
EVAL_PRIORITY = 50


def check_models(models: list[str]) -> None:
    """Raise ValueError naming the models that are not in the model registry (trace/models/registry.py): the
    schema only checks their `<family>-<flavor>` form, the registry knows the families."""
    # the registry imports transformers: only here, not for every use of the plan
    from trace.models.registry import FLAVORS

    unknown = [m for m in models if m not in FLAVORS]
    if unknown:
        raise ValueError(f"profile key 'models' / 'ablation.models': unknown model(s) {unknown}; "
                         f"the registered models are {list(FLAVORS)} (trace/models/registry.py)")


class Plan:
    """The runs of one profile and their paths. `config` is the validated profile dict."""

    def __init__(self, config: dict):
        self.config = config
        self.profile = config["profile"]
        self.runs_dir = config.get("runs_dir", f"results/runs/{self.profile}")
        self.tables_dir = config.get("tables_dir", f"results/tables/{self.profile}")
        self.figures_dir = config.get("figures_dir", f"figures/{self.profile}")
        self.sft_enabled = bool(config.get("sft", {}).get("enabled", True))
        # per_seed: every seed k trains its own SFT base (init seed k, data order k) into sft/seed<k>/, so the
        # spread over seeds includes the SFT's; otherwise one base (the first seed's) in sft/ serves every seed
        self.sft_per_seed = bool(config.get("sft", {}).get("per_seed", False))
        abl = config.get("ablation", {}) or {}
        unknown = [m for m in config["methods"] if m not in METHODS]
        unknown += [spec["method"] for spec in (abl.get("arms") or {}).values() if spec["method"] not in METHODS]
        if unknown:
            raise ValueError(f"profile key 'methods' / 'ablation.arms.*.method': unknown method(s) {unknown}; "
                             f"the arms are {list(METHODS)} (trace/arms.py)")
        self.arms: dict[str, dict] = {m: {"method": m, "set": {}} for m in config["methods"]}
        self.ablation_arms: dict[str, dict] = {}
        for name, spec in (abl.get("arms") or {}).items():
            if name in self.arms:
                raise ValueError(f"ablation arm {name!r} clashes with a method of the main table")
            self.ablation_arms[name] = {"method": spec["method"], "set": dict(spec.get("set") or {})}
        check_models([*config["models"], *abl.get("models", [])])
        # the alignment coefficient of every arm with the term, read from the rule's calibration files (one per
        # guided depth rho) of this flavor, never typed into the profile (DESIGN.md §3)
        self.calibration = config.get("align_calibration")
        if self.calibration:
            typed = ["defaults.rl"] if "align_coef" in (config.get("defaults", {}).get("rl") or {}) else []
            typed += [f"tasks.{t}.set" for t, sp in config["tasks"].items() if "rl.align_coef" in ((sp or {}).get("set") or {})]
            typed += [f"ablation.arms.{a}.set" for a, sp in (abl.get("arms") or {}).items()
                      if "rl.align_coef" in (sp.get("set") or {})]
            if typed:
                raise ValueError(f"rl.align_coef is set in {typed}, but profile key 'align_calibration' reads it "
                                 f"from the calibration files: remove it there")
        # train_ppo_ray flags for every RL run: only the OpenRLHF launch takes them (after `--`)
        self.openrlhf_flags = [t for item in config.get("openrlhf_flags") or [] for t in shlex.split(item)]
        if self.openrlhf_flags:
            if OPENRLHF_LAUNCH not in config["launcher"]["rl"]:
                raise ValueError(f"profile key 'openrlhf_flags' needs launcher.rl to be the OpenRLHF launch "
                                 f"(python -m {OPENRLHF_LAUNCH} --stage rl), not {config['launcher']['rl']!r}")
            if not self.openrlhf_flags[0].startswith("--"):
                raise ValueError(f"profile key 'openrlhf_flags' must start with a flag (--name), "
                                 f"got {self.openrlhf_flags[0]!r}")
        # the SFT base gate (trace/gate.py): RL runs of these tasks need their base's validation evaluation to pass
        self.gated_tasks = set(((config.get("checks") or {}).get("base_gate") or {}).get("tasks", []))
        unknown_gated = sorted(self.gated_tasks - set(config["tasks"]))
        if unknown_gated:
            raise ValueError(f"checks.base_gate.tasks: {unknown_gated} not in tasks")
        for task, spec in config["tasks"].items():
            extra = sorted(set((spec or {}).get("models", [])) - set(config["models"]))
            if extra:
                raise ValueError(f"tasks.{task}.models: {extra} not in models")
        runs: list[Run] = []
        for model, task, method, seed in itertools.product(
            config["models"], config["tasks"], config["methods"], config["seeds"]
        ):
            if self.runs_task(model, task):
                runs.append(Run(model, task, method, int(seed), method, False))
        abl_seeds = abl.get("seeds", config["seeds"])
        for model, task, arm, seed in itertools.product(
            abl.get("models", []), abl.get("tasks", []), self.ablation_arms, abl_seeds
        ):
            if task not in config["tasks"]:
                raise ValueError(f"ablation task {task!r} is not in tasks")
            runs.append(Run(model, task, arm, int(seed), self.ablation_arms[arm]["method"], True))
        seen = set()
        self.runs = [r for r in runs if not (r.key in seen or seen.add(r.key))]

    def rl_passthrough(self) -> str:
        """The rl rule's `-- FLAGS` (shell-quoted): the profile's openrlhf_flags for train_ppo_ray; '' without."""
        return " ".join(["--", *map(shlex.quote, self.openrlhf_flags)]) if self.openrlhf_flags else ""

    def runs_task(self, model: str, task: str) -> bool:
        """Whether the main table has (model, task): a task's `models` key restricts it to a subset."""
        only = (self.config["tasks"][task] or {}).get("models")
        return only is None or model in only

    def model_tasks(self) -> list[tuple[str, str]]:
        """(model, task) pairs of the main table, in profile order (each has an SFT base)."""
        return [(m, t) for m in self.config["models"] for t in self.config["tasks"] if self.runs_task(m, t)]

    # ---- paths -------------------------------------------------------------------------------
    def run_dir(self, model, task, arm, seed) -> str:
        return f"{self.runs_dir}/{model}/{task}/{arm}/seed{seed}"

    def sft_name(self, seed: int | None = None) -> str:
        """The SFT base's folder below <model>/<task>/ (and its config's name below configs/<model>/<task>/):
        `sft`, or `sft/seed<k>` with per-seed bases (the base of seed k's runs)."""
        if not self.sft_per_seed:
            return "sft"
        return f"sft/seed{self.config['seeds'][0] if seed is None else int(seed)}"

    def sft_seed(self, name: str) -> int:
        """The seed of an SFT base's folder name (`sft`: the profile's first seed)."""
        return int(name.split("seed")[1]) if "/seed" in name else int(self.config["seeds"][0])

    def sft_dir(self, model, task, seed: int | None = None) -> str:
        return f"{self.runs_dir}/{model}/{task}/{self.sft_name(seed)}"

    def run_config_path(self, model, task, arm, seed) -> str:
        return f"{self.runs_dir}/configs/{model}/{task}/{arm}-seed{seed}.yaml"

    def sft_config_path(self, model, task, seed: int | None = None) -> str:
        return f"{self.runs_dir}/configs/{model}/{task}/{self.sft_name(seed)}.yaml"

    def rl_priority(self, arm: str) -> int:
        """Snakemake priority of an arm's RL runs (rule rl): the longest runs start first, so that the runs of a
        chunk end close together and fewer are cut off when the machine's time ends (longest processing time first). The
        cost order, 1 + FP4 rollout + guidance record, is the order of the arms' seconds per step in the small
        profile's main table (results/tables/small/main.md, s/step)."""
        a = ARMS[self.arm_spec(arm)["method"]]
        return 1 + int(a.engine_mode != "bf16") + int(a.record == "guide")

    def arm_spec(self, arm: str) -> dict:
        if arm in self.arms:
            return self.arms[arm]
        if arm in self.ablation_arms:
            return self.ablation_arms[arm]
        raise KeyError(f"unknown arm {arm!r} (not a method or ablation arm of profile {self.profile!r})")

    # ---- configs -----------------------------------------------------------------------------
    def _base(self, model: str, task: str, seed: int) -> dict:
        d = copy.deepcopy(self.config.get("defaults", {}))
        spec = self.config["tasks"][task] or {}
        task_cfg = {k: v for k, v in spec.items() if k not in ("models", "set")}
        task_cfg = deep_merge({"seed": DATA_SEED}, task_cfg)
        d["model"] = model
        d["task"] = deep_merge(d.get("task", {}), {"name": task, **task_cfg})
        d["seed"] = int(seed)
        # the task's own settings over the defaults (e.g. its SFT's label smoothing), under every arm's
        for k, v in sorted((spec.get("set") or {}).items()):
            set_dotted(d, k, v)
        return d

    def sft_config(self, model: str, task: str, seed: int | None = None) -> dict:
        """The SFT base's config: the first seed's, or with per-seed bases seed k's, whose model init seed is
        k too (`sft.init_seed`), so two seeds share neither initialisation nor data order."""
        seed = int(self.config["seeds"][0] if seed is None or not self.sft_per_seed else seed)
        d = self._base(model, task, seed)
        d.pop("rl", None)
        if self.sft_per_seed:
            d.setdefault("sft", {})["init_seed"] = seed
        return d

    def run_config(self, model: str, task: str, arm: str, seed: int, calibrated: bool = True) -> dict:
        """The run's config. With `align_calibration`, an arm with the alignment term gets `rl.align_coef` from
        its depth's calibration file (CalibrationMissing if there is none); `calibrated=False` leaves it out
        (the trainer's default), for the calibration itself, which sets its own probe coefficient."""
        spec = self.arm_spec(arm)
        d = self._base(model, task, seed)
        d.pop("sft", None)
        d.setdefault("rl", {})["method"] = spec["method"]
        if self.sft_enabled:
            d["rl"]["init_ckpt"] = f"{self.sft_dir(model, task, seed)}/ckpt"
        for k, v in sorted(spec["set"].items()):
            set_dotted(d, k, v)
        if calibrated and self.calibration and ARMS[spec["method"]].align:
            d["rl"]["align_coef"] = self.align_coef(self.rho(d))
        return d

    # ---- the alignment coefficient's calibration (DESIGN.md §3) -------------------------------
    @staticmethod
    def rho(run_cfg: dict) -> float:
        """The guided depth of a run config (the trainer's default where the profile sets none)."""
        rho = (run_cfg.get("rl") or {}).get("rho")
        if rho is None:
            rho = DEFAULTS["rl"]["rho"]
        return float(rho)

    def calibration_path(self, rho: float) -> str:
        """The calibration file of guided depth `rho`: <dir>/align_calibration_<flavor>_rho<rho>.json, dir relative
        to the repository root (default results/guidance)."""
        c = self.calibration
        d = c.get("dir", "results/guidance")
        return os.path.join(_ROOT, d, f"align_calibration_{c['model']}_rho{float(rho):g}.json")

    def align_coef(self, rho: float) -> float:
        """`align_coef` of the calibration file of depth `rho`, checked against its flavor and depth."""
        path = self.calibration_path(rho)
        if not os.path.isfile(path):
            raise CalibrationMissing(f"no alignment calibration {os.path.relpath(path, _ROOT)}: run "
                                     f"scripts/gpu/calibrate_unit.sh first (DESIGN.md §3)")
        with open(path) as f:
            rep = json.load(f)
        if rep.get("model") != self.calibration["model"] or float(rep.get("rho", -1)) != float(rho):
            raise ValueError(f"{path}: calibrated for {rep.get('model')} at rho {rep.get('rho')}, not "
                             f"{self.calibration['model']} at rho {float(rho):g}")
        coef = rep.get("align_coef")
        if not isinstance(coef, (int, float)) or isinstance(coef, bool) or not coef > 0:
            raise ValueError(f"{path}: align_coef {coef!r} is not a positive number")
        return float(coef)

    def calibration_rhos(self) -> list[float]:
        """The guided depths whose calibration the profile's runs read (of the arms with the term)."""
        if not self.calibration:
            return []
        return sorted({self.rho(self.run_config(r.model, r.task, r.arm, r.seed, calibrated=False))
                       for r in self.runs if ARMS[r.method].align})

    def check_calibration(self) -> None:
        """Every calibration file the runs read exists and fits (else CalibrationMissing naming every missing file,
        or ValueError; one line)."""
        rhos = self.calibration_rhos()
        missing = [os.path.relpath(self.calibration_path(r), _ROOT) for r in rhos
                   if not os.path.isfile(self.calibration_path(r))]
        if missing:
            raise CalibrationMissing(f"no alignment calibration {', '.join(missing)}: run scripts/gpu/calibrate_unit.sh "
                                     f"first (DESIGN.md §3)")
        for rho in rhos:
            self.align_coef(rho)

    # ---- the SFT base gate (trace/gate.py) -------------------------------------------------------
    def gated(self, task: str) -> bool:
        return task in self.gated_tasks

    def base_validation(self, model: str, task: str, seed: int | None = None) -> str:
        """The SFT base's evaluation on the validation split, which the gate reads."""
        return f"{self.sft_dir(model, task, seed)}/validation.json"

    def gate_arm(self) -> str:
        """The arm whose run config evaluates a base for the gate (its eval settings; eval.split validation):
        the learning check's arm, else the first method."""
        return (self.learning or {}).get("arm") or self.config["methods"][0]

    def manifest(self) -> dict:
        """What the tables must contain: one entry per run (analysis/tables.py --manifest)."""
        return {
            "profile": self.profile,
            "runs_dir": self.runs_dir,
            "runs": [
                {"model": r.model, "task": r.task, "arm": r.arm, "seed": r.seed, "method": r.method,
                 "ablation": r.ablation, "dir": self.run_dir(r.model, r.task, r.arm, r.seed)}
                for r in self.runs
            ],
        }


    @property
    def learning(self) -> dict | None:
        """The profile's learning check (checks.learning), or None (none asked for, or no SFT base)."""
        return (self.config.get("checks") or {}).get("learning") if self.sft_enabled else None

    def run_evals(self, model: str | None = None, task: str | None = None) -> list[str]:
        """Each run's eval.json (of `model` and `task` where given)."""
        return [f"{self.run_dir(r.model, r.task, r.arm, r.seed)}/eval.json" for r in self.runs
                if model in (None, r.model) and task in (None, r.task)]

    def base_evals(self, model: str | None = None, task: str | None = None) -> list[str]:
        """The SFT bases' evaluations that the learning check reads ([] without the check)."""
        seeds = self.config["seeds"] if self.sft_per_seed else [None]
        return [f"{self.sft_dir(m, t, k)}/eval.json" for m, t in self.model_tasks() for k in seeds
                if model in (None, m) and task in (None, t)] if self.learning else []

    def targets(self, model: str, task: str | None = None) -> list[str]:
        """Every file that completes `model`'s runs (of `task`, else of every task): each run's eval.json
        and, with the learning check on, its SFT base's evaluation. A stretch of GPU time that must
        finish what it starts (checkpoints stay on the machine) runs these as Snakemake targets."""
        runs = self.run_evals(model, task)
        if not runs:
            raise ValueError(f"no runs of {model!r}" + (f" on {task!r}" if task else "") + " in this profile")
        return runs + self.base_evals(model, task)


if __name__ == "__main__":
    import argparse

    import yaml

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--targets", nargs="+", metavar=("MODEL", "TASK"),
                    help="print one model's (and task's) target files, one per line, instead of the manifest")
    args = ap.parse_args()
    with open(args.profile) as f:
        plan = Plan(yaml.safe_load(f))
    if args.targets:
        print("\n".join(plan.targets(*args.targets[:2])))
    else:
        print(json.dumps(plan.manifest(), indent=1))
