"""analysis/openrlhf_compare.py on synthetic run trees: the side-by-side numbers are the per-run summaries'
(means over seeds, OpenRLHF minus embedded, OpenRLHF over embedded), the arm's deployment picks the accuracy,
and run trees of the wrong kind or with different run configs are refused."""
import json

import pytest
import yaml

from analysis.openrlhf_compare import compare, main
from trace import config as C

ARMS = ("bf16", "trace")


def _run(root, kind, arm, seed, *, acc, k3, step_s, gbytes, lr=3e-5):
    d = root / "qwen3_moe-small" / "reasoning" / arm / f"seed{seed}"
    d.mkdir(parents=True)
    cfg = {"model": "qwen3_moe-small", "seed": seed, "task": {"name": "reasoning"},
           "rl": {"method": arm, "lr": lr, "init_ckpt": str(root / "sft")}}
    (d / "config.yaml").write_text(yaml.safe_dump(C.deep_merge(C.DEFAULTS, cfg)))  # resolved, as a run's
    (d / "meta.json").write_text(json.dumps({"kind": kind}))
    lines = [{"step": 0, "method": arm, "eval_accuracy": 0.1}]
    lines += [{"step": s, "method": arm, "accuracy": 0.5, "k3": k3, "time_step_s": step_s,
               "rollout_gen_tokens_per_s": 1000.0, "guidance_bytes_per_gen_token": gbytes} for s in range(1, 6)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    blk = lambda a: {"accuracy": a, "reward": a, "n_prompts": 100, "se": 0.01}  # noqa: E731
    (d / "eval.json").write_text(json.dumps({"bf16": blk(acc), "fp4": blk(acc - 0.2)}))
    (d / "done").write_text("{}\n")


def _trees(tmp_path, emb_lr=3e-5, emb_kind="rl"):
    orl, emb = tmp_path / "orl", tmp_path / "emb"
    for seed in (0, 1):
        _run(orl, "rl-openrlhf", "bf16", seed, acc=0.6 + 0.1 * seed, k3=2e-4, step_s=4.0, gbytes=0.0)
        _run(orl, "rl-openrlhf", "trace", seed, acc=0.7, k3=1e-3, step_s=12.0, gbytes=3000.0)
        _run(emb, emb_kind, "bf16", seed, acc=0.5, k3=1e-4, step_s=1.0, gbytes=0.0, lr=emb_lr)
        _run(emb, emb_kind, "trace", seed, acc=0.6, k3=5e-4, step_s=3.0, gbytes=1000.0, lr=emb_lr)
    return orl, emb


def test_side_by_side_numbers(tmp_path):
    orl, emb = _trees(tmp_path)
    df = compare(str(orl), str(emb)).set_index("arm")
    assert sorted(df.index) == list(ARMS)
    b, t = df.loc["bf16"], df.loc["trace"]
    assert b["seeds_openrlhf"] == 2 and b["seeds_embedded"] == 2
    # bf16 deploys in BF16 (mean of 0.6 and 0.7), trace in FP4 (0.2 lower)
    assert b["acc_deploy_openrlhf"] == pytest.approx(0.65) and b["acc_deploy_diff"] == pytest.approx(0.15)
    assert t["acc_deploy_openrlhf"] == pytest.approx(0.5) and t["acc_deploy_embedded"] == pytest.approx(0.4)
    assert t["k3_mean_ratio"] == pytest.approx(2.0) and t["step_s_ratio"] == pytest.approx(4.0)
    assert t["guidance_bytes_per_gen_token_ratio"] == pytest.approx(3.0)
    assert t["train_acc_final_diff"] == pytest.approx(0.0)
    out = tmp_path / "out"
    assert main(["--openrlhf", str(orl), "--embedded", str(emb), "--out", str(out)]) == 0
    md = (out / "openrlhf_vs_embedded.md").read_text()
    assert "| trace |" in md and "master weights" in md and (out / "openrlhf_vs_embedded.csv").exists()


def test_wrong_kind_refused(tmp_path):
    orl, emb = _trees(tmp_path, emb_kind="rl-openrlhf")
    with pytest.raises(ValueError, match="kind 'rl-openrlhf'"):
        compare(str(orl), str(emb))


def test_different_configs_refused(tmp_path):
    orl, emb = _trees(tmp_path, emb_lr=1e-4)
    with pytest.raises(ValueError, match=r"differ in \['rl.lr'\]"):
        compare(str(orl), str(emb))
