"""analysis.report: the claims' verdicts follow their fixed rules from the tables, and README.md's generated
block equals what the committed tables give."""
import pandas as pd

from analysis.report import claims, paste_readme, readme_block


def _cmp(rows):
    return pd.DataFrame([{"model": m, "task": "reasoning", "a": a, "b": b, "diff": (lo + hi) / 2, "lo_holm": lo,
                          "hi_holm": hi} for m, a, b, lo, hi in rows])


def _main(k3, rlen=3.0):
    return pd.DataFrame([{"model": m, "task": "reasoning", "arm": arm, "k3_mean": v, "response_len": rlen}
                         for m, arms in k3.items() for arm, v in arms.items()])


def test_verdicts_follow_the_holm_intervals():
    cmp = _cmp([("m1", "trace (FP4)", "bf16 (BF16)", -0.03, -0.01),    # lower
                ("m2", "trace (FP4)", "bf16 (BF16)", -0.02, 0.02),     # no difference detected
                ("m1", "trace (FP4)", "bf16 (FP4)", 0.01, 0.03),       # higher
                ("m2", "trace (FP4)", "bf16 (FP4)", 0.01, 0.02),
                ("m1", "trace (FP4)", "qat-independent (FP4)", 0.005, 0.04),
                ("m2", "trace (FP4)", "qat-independent (FP4)", 0.002, 0.03),
                ("m1", "fp4-naive (FP4)", "bf16 (BF16)", -0.05, -0.01),
                ("m2", "fp4-naive (FP4)", "bf16 (BF16)", -0.05, 0.01)])
    k3 = {"m1": {"bf16": 1e-4, "qat-independent": 1e-2, "trace": 1e-4, "fp4-naive": 3e-2},
          "m2": {"bf16": 1e-4, "qat-independent": 2e-2, "trace": 1e-3, "fp4-naive": 3e-2}}
    t = claims(_main(k3), cmp).set_index("claim")["verdict"]
    assert t["FP4 rollout with TRACE performs like BF16 rollout"] == "fails in 1 of 2 settings"
    assert t["TRACE beats post-hoc FP4 and independent QAT when deployed in FP4"] == "holds"
    assert t["TRACE removes the train/rollout mismatch"] == \
        "lowers it 20.0-100.0x; removes it (k3 at or below bf16's) in 1 of 2 settings"
    assert t["Naive FP4 rollout degrades on long generations"].startswith("not tested: responses 3.0-3.0 tokens")
    long = claims(_main(k3, rlen=120.0), cmp).set_index("claim")["verdict"]
    assert long["Naive FP4 rollout degrades on long generations"] == "holds in 1 of 2 long-response settings"


def test_readme_block_is_the_committed_tables():
    text = open("README.md").read()
    assert paste_readme(text, readme_block()) == text, "run: python -m analysis.report --readme README.md"
