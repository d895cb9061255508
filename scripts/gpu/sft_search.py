"""The SFT recipe search of the long reasoning task (DESIGN.md §4 "SFT recipe"): candidate SFT bases of the
calibration flavor, each evaluated on the VALIDATION split in BF16 and FP4 with the profile's eval settings, and the
rule that picks one. scripts/gpu/sft_search_unit.sh runs it on one GPU; this file holds the grid, the configs, the
summaries and the rule, so that the dry run and the tests read what the unit runs.

    python scripts/gpu/sft_search.py dry-run [PROFILE MODEL TASK]     # the candidates and their configs (CPU)
    python scripts/gpu/sft_search.py prepare PROFILE MODEL TASK WORK  # WORK/<name>/{sft,eval}.yaml; prints the names
    python scripts/gpu/sft_search.py summarise WORK OUT NAME...       # OUT/candidate_<name>.json, OUT/chosen.json

The rule (fixed before the search runs): a candidate qualifies when its base passes the SFT base gate
(trace/gate.py: validation accuracy in 0.15-0.85 in BF16 and in FP4, mean response 40+ tokens in both). Among those,
the pick is the first by (1) difficulty, medium before easy (the protocol's long task: gold responses ~71 tokens
against ~48), (2) fewest SFT steps (the cheapest base: every seed of every family trains one), (3) highest FP4
validation accuracy, (4) highest BF16 validation accuracy, (5) grid order. None qualifying: no pick, the unit exits 1,
and no calibration or RL run starts until a new grid, written into DESIGN.md first, has one.
"""
from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trace.gate import failures  # noqa: E402
from workflow.scripts.runplan import Plan, set_dotted  # noqa: E402

# The grid: dotted run-config keys over the profile's own SFT config of the task (batch 64, warmup 20, cosine decay,
# seed 0). Side by side on one H100 at ~0.5 s per step each, a 1,500-step base takes ~12 min, the 3,000-step one ~25.
CANDIDATES: list[dict] = [
    {"name": "medium-ls0.05", "set": {"task.difficulty": "medium", "sft.label_smoothing": 0.05, "sft.steps": 1500}},
    {"name": "medium-ls0", "set": {"task.difficulty": "medium", "sft.label_smoothing": 0.0, "sft.steps": 1500}},
    {"name": "medium-ls0-lr3e-4", "set": {"task.difficulty": "medium", "sft.label_smoothing": 0.0, "sft.steps": 1500,
                                          "sft.lr": 3.0e-4}},
    {"name": "medium-ls0-n32k", "set": {"task.difficulty": "medium", "sft.label_smoothing": 0.0, "sft.steps": 1500,
                                        "task.n_train": 32768}},
    {"name": "medium-ls0-n32k-3000", "set": {"task.difficulty": "medium", "sft.label_smoothing": 0.0,
                                             "sft.steps": 3000, "task.n_train": 32768}},
    {"name": "easy-ls0.05", "set": {"task.difficulty": "easy", "sft.label_smoothing": 0.05, "sft.steps": 1500}},
]
DIFFICULTY_ORDER = ("medium", "easy")
SEED = 0


def _plan(profile: str) -> Plan:
    import yaml
    with open(ROOT / "experiments" / "profiles" / f"{profile}.yaml") as f:
        return Plan(yaml.safe_load(f))


def configs(profile: str, model: str, task: str) -> dict[str, dict]:
    """Per candidate: its SFT config and its evaluation config (the profile's gate arm's run config of seed 0, on
    the validation split), both with the candidate's keys set."""
    plan = _plan(profile)
    sft = plan.sft_config(model, task, SEED)
    ev = plan.run_config(model, task, plan.gate_arm(), SEED, calibrated=False)
    ev["eval"] = dict(ev.get("eval") or {}, split="validation")
    out = {}
    for c in CANDIDATES:
        s, e = copy.deepcopy(sft), copy.deepcopy(ev)
        for k, v in c["set"].items():
            set_dotted(s, k, v)
            if not k.startswith("sft."):
                set_dotted(e, k, v)
        e["rl"].pop("init_ckpt", None)  # the evaluation names its checkpoint itself
        out[c["name"]] = {"set": c["set"], "sft": s, "eval": e}
    return out


def summary(work: str | Path, name: str) -> dict:
    """One candidate's summary: validation accuracy (BF16, FP4) with its SE, mean response tokens, SFT seconds, the
    gate's verdict (its failures, [] when it passes)."""
    d = Path(work) / name
    spec = next(c for c in CANDIDATES if c["name"] == name)
    out = {"name": name, "set": spec["set"]}
    sec = d / "sft_seconds"
    out["sft_seconds"] = float(sec.read_text()) if sec.exists() else None
    val = d / "validation.json"
    if not val.exists():
        return {**out, "gate": ["no validation evaluation (SFT or evaluation failed)"], "passes": False}
    ev = json.loads(val.read_text())
    for m in ("bf16", "fp4"):
        out[m] = {k: ev[m][k] for k in ("accuracy", "se", "response_len", "n", "n_prompts")}
    out["gate"] = failures(ev)
    out["passes"] = not out["gate"]
    return out


def choose(summaries: list[dict]) -> dict | None:
    """The rule's pick among the summaries (module docstring), or None when no candidate passes the gate."""
    order = {c["name"]: i for i, c in enumerate(CANDIDATES)}
    ok = [s for s in summaries if s["passes"]]
    if not ok:
        return None
    return min(ok, key=lambda s: (DIFFICULTY_ORDER.index(s["set"]["task.difficulty"]), s["set"]["sft.steps"],
                                  -s["fp4"]["accuracy"], -s["bf16"]["accuracy"], order[s["name"]]))


def main(argv=None) -> int:
    import yaml
    a = list(sys.argv[1:] if argv is None else argv)
    cmd = a.pop(0) if a else ""
    if cmd == "dry-run":
        profile, model, task = a or ("small-v2", "qwen3_moe-small", "reasoning")
        cfgs = configs(profile, model, task)
        print(f"SFT recipe search ({profile}, {model}, {task}, seed {SEED}): {len(cfgs)} candidate bases, side by "
              f"side on one GPU; each evaluated on the validation split in BF16 and FP4")
        for name, c in cfgs.items():
            print(f"\n## {name}: " + ", ".join(f"{k}={v}" for k, v in c["set"].items()))
            print(yaml.safe_dump({"sft_config": c["sft"], "eval_config": c["eval"]}, sort_keys=False).rstrip())
        return 0
    if cmd == "prepare":
        profile, model, task, work = a
        most = int(os.environ.get("SFT_SEARCH_MAX_STEPS") or 0)  # a unit of the candidates up to that many steps
        for name, c in configs(profile, model, task).items():
            if most and c["set"]["sft.steps"] > most:
                continue
            os.makedirs(f"{work}/{name}", exist_ok=True)
            for what in ("sft", "eval"):
                with open(f"{work}/{name}/{what}.yaml", "w") as f:
                    yaml.safe_dump(c[what], f, sort_keys=False)
            print(name)
        return 0
    if cmd == "summarise":
        work, out, *names = a
        os.makedirs(out, exist_ok=True)
        sums = [summary(work, n) for n in names]
        for s in sums:
            Path(out, f"candidate_{s['name']}.json").write_text(json.dumps(s, indent=1) + "\n")
            acc = ("  ".join(f"{m} {s[m]['accuracy']:.3f}±{s[m]['se']:.3f} ({s[m]['response_len']:.0f} tok)"
                             for m in ("bf16", "fp4")) if "bf16" in s else "-")
            print(f"{s['name']:24s} {acc}  sft {s['sft_seconds']} s  " + ("PASS" if s["passes"] else
                                                                          "fail: " + "; ".join(s["gate"])))
        pick = choose(sums)
        rule = "DESIGN.md §4 SFT recipe: passes the gate; medium first; fewest steps; highest FP4, then BF16 accuracy"
        Path(out, "chosen.json").write_text(json.dumps({"rule": rule, "chosen": pick and pick["name"],
                                                        "set": pick and pick["set"]}, indent=1) + "\n")
        if pick is None:
            print("error: no candidate SFT base passes the gate (DESIGN.md §4): no calibration or RL run starts",
                  file=sys.stderr)
            return 1
        print(f"chosen: {pick['name']} (set {pick['set']} in the profile's tasks.<task>.set)")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
