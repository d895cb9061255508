"""The same runs through OpenRLHF and through the embedded trainer, side by side.

    python -m analysis.openrlhf_compare --openrlhf results/openrlhf/small-table/openrlhf \
        --embedded results/openrlhf/small-table/embedded --out results/openrlhf/small-table

Inputs: two run trees as analysis/runs.py reads them (`<model>/<task>/<arm>/seed<k>/`), one made by
`trace.integrations.openrlhf.launch` (meta.json kind `rl-openrlhf`), one by `python -m trace.rl` (kind `rl`),
from the same profile (scripts/gpu/openrlhf_table.sh runs experiments/profiles/openrlhf-small.yaml both ways
from one SFT base). A run tree holding the other kind is refused, and so is a pair whose run configs differ
in anything but the run dir's own paths (`DIFF_OK`): the comparison is of the frameworks, not of settings.

Per model, task and arm, for each framework (mean over the seeds it has): final held-out accuracy in the
arm's deployment and in BF16 (eval.json; its SE the main table's), mean training accuracy over the last 20%
of steps, k3 (mean over steps and over the last 20%), median step time, median rollout generated tokens per
second, guidance bytes per generated token; then the OpenRLHF minus embedded difference of the accuracies and
the OpenRLHF / embedded ratio of k3, step time and bytes. Writes `openrlhf_vs_embedded.csv` and `.md`; the
markdown ends with the differences between the two paths that these numbers carry (`DIFFERENCES`).
Compared against: analysis/runs.py's per-run summary (the same columns, computed by `summarize`).
"""
from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import pandas as pd

from analysis.runs import RunData, load_runs, summarize

KIND = {"openrlhf": "rl-openrlhf", "embedded": "rl"}
# config keys that name where a run lives rather than what it computes
DIFF_OK = ("rl.init_ckpt",)
COLUMNS = (  # (output name, summarize's column)
    ("acc_deploy", None), ("acc_deploy_se", None), ("acc_bf16", "acc_bf16"), ("train_acc_final", "train_acc_final"),
    ("k3_mean", "k3_mean"), ("k3_final", "k3_final"), ("step_s", "step_s"),
    ("gen_tok_per_s", "rollout_gen_tokens_per_s"), ("guidance_bytes_per_gen_token", "guidance_bytes_per_gen_token"),
)
DIFFERENCES = (
    "Trainer precision: OpenRLHF trains BF16 parameters (`--ds.param_dtype bf16`, DeepSpeed keeps the FP32 optimizer "
    "copy); the embedded trainer keeps FP32 master weights and runs the forward under BF16 autocast, so its "
    "non-matmul ops (norms, softmax, residual adds) run in FP32. With FP4 rounding in between, the first-step "
    "log-probs differ by up to ~0.08 (tests/integrations/openrlhf/test_equivalence.py), which shows in k3.",
    "Prompt rows per sample: OpenRLHF asks the engine for one sample per request, so each sample's guidance "
    "record carries its own copy of the prompt rows; the embedded engine records a prompt once for its group. "
    "Guidance bytes per generated token are therefore higher through OpenRLHF by about (group_size - 1) x "
    "prompt tokens / generated tokens of the prompt rows.",
    "Prompt order: both draw each step's prompts from the same seeded list, but OpenRLHF's dataloader shuffles "
    "that list with its own generator, so the two paths see different prompts at a given step.",
    "Step time: the OpenRLHF step adds Ray calls, a separate old-log-prob forward (the experience maker's), the "
    "weight broadcast to the engine actor and the records' trip through the object store; the embedded step "
    "reuses its one forward and syncs weights in process.",
)


def check_kind(runs: list[RunData], framework: str) -> None:
    want = KIND[framework]
    for r in runs:
        path = os.path.join(r.dir, "meta.json")
        kind = json.load(open(path)).get("kind") if os.path.exists(path) else None
        if kind != want:
            raise ValueError(f"{r.dir}: meta.json kind {kind!r}, but the {framework} side needs {want!r}")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(a: RunData, b: RunData) -> list[str]:
    """Keys whose resolved values differ between two runs' config.yaml (DIFF_OK aside)."""
    fa, fb = _flat(a.config or {}), _flat(b.config or {})
    return sorted(k for k in set(fa) | set(fb) if k not in DIFF_OK and fa.get(k) != fb.get(k))


def _row(r: RunData) -> dict:
    s = summarize(r)
    dep = _deploy(r)  # the arm's deployment: bf16, or fp4 for the FP4-trained arms
    out = {"acc_deploy": s[f"acc_{dep}"], "acc_deploy_se": s[f"acc_{dep}_se"]}
    out.update({name: s[col] for name, col in COLUMNS if col is not None})
    return out


def _deploy(r: RunData) -> str:
    from trace.arms import ARMS
    return ARMS[r.method].deploy


def _mean(vals) -> float:
    v = np.array([x for x in vals if isinstance(x, (int, float)) and not math.isnan(x)], dtype=float)
    return float(v.mean()) if v.size else math.nan


def compare(orl_dir: str, emb_dir: str) -> pd.DataFrame:
    """One row per (model, task, arm) present on both sides."""
    sides = {"openrlhf": load_runs(orl_dir), "embedded": load_runs(emb_dir)}
    for fw, runs in sides.items():
        check_kind(runs, fw)
    by = {fw: {} for fw in sides}
    for fw, runs in sides.items():
        for r in runs:
            by[fw].setdefault((r.model, r.task, r.arm), []).append(r)
    rows = []
    for key in sorted(set(by["openrlhf"]) & set(by["embedded"])):
        o, e = by["openrlhf"][key], by["embedded"][key]
        for ro in o:
            for rb in e:
                if ro.seed == rb.seed and (diff := config_differences(ro, rb)):
                    raise ValueError(f"{ro.dir} vs {rb.dir}: the run configs differ in {diff}")
        row = {"model": key[0], "task": key[1], "arm": key[2], "seeds_openrlhf": len(o), "seeds_embedded": len(e)}
        vals = {}
        for fw, runs in (("openrlhf", o), ("embedded", e)):
            summ = [_row(r) for r in runs]
            for name, _ in COLUMNS:
                vals[(fw, name)] = _mean(s[name] for s in summ)
                row[f"{name}_{fw}"] = vals[(fw, name)]
        for name in ("acc_deploy", "acc_bf16", "train_acc_final"):
            row[f"{name}_diff"] = vals[("openrlhf", name)] - vals[("embedded", name)]
        for name in ("k3_mean", "step_s", "guidance_bytes_per_gen_token"):
            den = vals[("embedded", name)]
            row[f"{name}_ratio"] = vals[("openrlhf", name)] / den if den and not math.isnan(den) else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def _fmt(x, digits: int = 3) -> str:
    if isinstance(x, str):
        return x
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def to_markdown(df: pd.DataFrame) -> str:
    cols = [("arm", "arm"), ("seeds", None), ("acc (deploy) OpenRLHF / embedded / diff", "acc_deploy"),
            ("train acc (last 20%)", "train_acc_final"), ("k3 mean", "k3_mean"), ("step s (median)", "step_s"),
            ("gen tok/s", "gen_tok_per_s"), ("guidance B / gen token", "guidance_bytes_per_gen_token")]
    lines = ["| model | task | " + " | ".join(c for c, _ in cols) + " |", "|" + " --- |" * (len(cols) + 2)]
    for _, r in df.iterrows():
        cells = [r["model"], r["task"]]
        for _, k in cols:
            if k == "arm":
                cells.append(r["arm"])
            elif k is None:
                cells.append(f"{r['seeds_openrlhf']} / {r['seeds_embedded']}")
            elif k == "acc_deploy":
                cells.append(f"{_fmt(r[k + '_openrlhf'])} ± {_fmt(r['acc_deploy_se_openrlhf'], 2)} / "
                             f"{_fmt(r[k + '_embedded'])} ± {_fmt(r['acc_deploy_se_embedded'], 2)} / {_fmt(r[k + '_diff'], 2)}")
            else:
                cells.append(f"{_fmt(r[k + '_openrlhf'])} / {_fmt(r[k + '_embedded'])}")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    notes = ["", "Each cell: OpenRLHF / embedded (mean over seeds). What differs between the two paths:", ""]
    notes += [f"- {d}" for d in DIFFERENCES]
    return "\n".join(lines + notes) + "\n"


def write_outputs(df: pd.DataFrame, out: str, stem: str, md: str) -> None:
    """df as OUT/STEM.csv, md as OUT/STEM.md, and md on stdout."""
    os.makedirs(out, exist_ok=True)
    df.to_csv(os.path.join(out, f"{stem}.csv"), index=False)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(md)
    print(md)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--openrlhf", required=True, help="run tree made through OpenRLHF (kind rl-openrlhf)")
    ap.add_argument("--embedded", required=True, help="run tree of the same profile through python -m trace.rl")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    df = compare(a.openrlhf, a.embedded)
    if df.empty:
        raise SystemExit("no model/task/arm has runs on both sides")
    write_outputs(df, a.out, "openrlhf_vs_embedded", to_markdown(df))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
