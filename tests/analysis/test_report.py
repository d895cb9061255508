"""analysis.report: the claims' verdicts follow their fixed rules from the tables, and README.md's generated
block equals what the committed tables give."""
import pandas as pd

from analysis.report import claims, paste_readme, readme_block


def _cmp(rows):
    """compare.csv rows: (model, A, B, Holm verdict, TOST p); the simultaneous interval around a difference."""
    d = {"higher": 0.02, "lower": -0.02, "no difference detected": 0.0}
    return pd.DataFrame([{"model": m, "task": "reasoning", "a": a, "b": b, "diff": d[v], "lo_sim": d[v] - 0.03,
                          "hi_sim": d[v] + 0.03, "verdict": v, "p_equiv": pe} for m, a, b, v, pe in rows])


def _main(k3, rlen=3.0):
    return pd.DataFrame([{"model": m, "task": "reasoning", "arm": arm, "k3_mean": v, "response_len": rlen}
                         for m, arms in k3.items() for arm, v in arms.items()])


K3 = {"m1": {"bf16": 1e-4, "qat-independent": 1e-2, "trace": 1e-4, "fp4-naive": 3e-2},
      "m2": {"bf16": 1e-4, "qat-independent": 2e-2, "trace": 1e-3, "fp4-naive": 3e-2}}


def test_verdicts_follow_holm_and_equivalence_needs_tost_in_every_setting():
    """A difference counts where Holm's step-down rejected (the verdict column, not the interval); "performs like
    BF16" needs TOST in every setting, and no difference detected alone is not equivalence."""
    cmp = _cmp([("m1", "trace (FP4)", "bf16 (BF16)", "lower", 0.6),
                ("m2", "trace (FP4)", "bf16 (BF16)", "no difference detected", 0.01),
                ("m1", "trace (FP4)", "bf16 (FP4)", "higher", 0.9),
                ("m2", "trace (FP4)", "bf16 (FP4)", "higher", 0.9),
                ("m1", "trace (FP4)", "qat-independent (FP4)", "higher", 0.9),
                ("m2", "trace (FP4)", "qat-independent (FP4)", "higher", 0.9),
                ("m1", "fp4-naive (FP4)", "bf16 (BF16)", "lower", 0.9),
                ("m2", "fp4-naive (FP4)", "bf16 (BF16)", "no difference detected", 0.9)])
    t = claims(_main(K3), cmp).set_index("claim")
    v = t["verdict"]
    assert v["FP4 rollout with TRACE performs like BF16 rollout"] == "not shown (equivalent within ±0.02 in 1 of 2 settings)"
    assert "0 higher, 1 lower, 1 no difference detected of 2 settings" in t.loc[
        "FP4 rollout with TRACE performs like BF16 rollout", "evidence"]
    assert v["TRACE beats post-hoc FP4 and independent QAT when deployed in FP4"] == "holds"
    assert v["TRACE removes the train/rollout mismatch"] == \
        "lowers it 20.0-100.0x; removes it (k3 at or below bf16's) in 1 of 2 settings"
    assert v["Naive FP4 rollout degrades on long generations"].startswith("not tested: responses 3.0-3.0 tokens")
    long = claims(_main(K3, rlen=120.0), cmp).set_index("claim")["verdict"]
    assert long["Naive FP4 rollout degrades on long generations"] == "holds in 1 of 2 long-response settings"
    # no setting different is not equivalence; TOST in both is
    nd = _cmp([("m1", "trace (FP4)", "bf16 (BF16)", "no difference detected", 0.3),
               ("m2", "trace (FP4)", "bf16 (BF16)", "no difference detected", 0.2)])
    assert claims(_main(K3), nd).set_index("claim")["verdict"].iloc[0].startswith("not shown")
    eq = _cmp([("m1", "trace (FP4)", "bf16 (BF16)", "no difference detected", 0.01),
               ("m2", "trace (FP4)", "bf16 (BF16)", "lower", 0.04)])
    assert claims(_main(K3), eq).set_index("claim")["verdict"].iloc[0] == "equivalent within ±0.02"


def test_readme_block_is_the_committed_tables():
    text = open("README.md").read()
    assert paste_readme(text, readme_block()) == text, "run: python -m analysis.report --readme README.md"


def test_rl_step_takes_ratios_within_a_run_whatever_the_arm_order(tmp_path):
    from analysis.report import rl_step

    base = dict(version="m1", commit="abc1234", gpu="NVIDIA H200", model="qwen3_moe-medium", task="reasoning",
                fp4_kernels="auto", batch=256, gen=1024, forced=True, steps=2, micro_batch=32, peak_gb=90.0,
                record_s=0.0, record_bytes_per_token=0.0, replay_s=0.0, fwd_bwd_s=1.0, k3=1e-3)
    older = dict(base, version="m0", arm="bf16", tok_s=1.0, rollout_s=9.0, train_s=1.0)  # another run's reference
    rows = [older, dict(base, arm="bf16", tok_s=100.0, rollout_s=2.0, train_s=4.0),
            # trace timed before qat-independent: its ratio to qat-independent still comes from the same run
            dict(base, arm="trace", tok_s=50.0, rollout_s=4.0, train_s=9.0, record_s=0.1, replay_s=3.0),
            dict(base, arm="qat-independent", tok_s=125.0, rollout_s=1.6, train_s=6.0),
            # the same arm under a setting of its own is a row of its own, not a replacement
            dict(base, arm="trace", tok_s=60.0, rollout_s=4.0, train_s=7.5, note="x; TRACE_FP4_ALIGN=on"),
            # a small flavor's run in the same table, appended later: not the medium shapes' text
            dict(base, version="v2step", model="qwen3_moe-small", arm="bf16", tok_s=9.0, rollout_s=1.0, train_s=1.0)]
    path = tmp_path / "rlstep.csv"
    pd.DataFrame(rows).to_csv(path, index=False)  # the newest medium run (m1) comes last
    text = rl_step(str(path))
    lines = {ln.split("|")[3].strip(): ln for ln in text.splitlines() if ln.startswith("| qwen3")}
    assert set(lines) == {"bf16", "qat-independent", "trace", "trace TRACE_FP4_ALIGN=on"}
    assert "| 1.25x |" in lines["trace TRACE_FP4_ALIGN=on"]  # 7.5 / 6 s train
    assert "| 0.50x |" in lines["trace"] and "| 1.50x |" in lines["trace"]  # 50/100 tok/s, 9/6 s train
    assert "| 1.25x |" in lines["qat-independent"]
    assert "one timed step" in text and "rollout 4.00 s against qat-independent's 1.60 s" in text
    assert "qwen3_moe-small" not in text and "version m1" in text
    assert rl_step(str(tmp_path / "missing.csv")) == ""
