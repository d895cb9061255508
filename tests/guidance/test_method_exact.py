"""The exact arm's method object (trace/guidance/method.py, DESIGN.md §4 "Exact on-policy arm"): no guidance record,
no diagnostic record even where diag_flips is on, no alignment term, zero guidance bytes; the other arms unchanged."""
from trace import config as C
from trace.arms import ARMS
from trace.guidance import Method
from trace.guidance.select import arm_records


def _method(arm: str, *over: str) -> Method:
    return Method.from_config(C.load_config(None, [f"rl.method={arm}", *over])["rl"])


def test_exact_takes_no_record_and_no_term():
    m = _method("exact", "rl.diag_flips=true", "rl.align_coef=5")
    assert m.exact and m.records() == (False, False) and m.recorders(8) == (None, None)
    assert m.record_bytes_per_generated_token(None, 10) == 0.0 and m.record_bits_per_element(None) is None
    assert not m.aligns and m.alignment(None) is None
    with m.replay(object(), None, None, None, None) as stats:
        assert stats is None
    arm = ARMS["exact"]
    assert arm.guidance == "none" and arm.deploy == "fp4" and arm.engine_mode == "w4a4" and arm.kv_fp4
    assert arm.trainer_mode == "w4a4kv4" and not arm.main  # the QAT forward gives its gradient


def test_only_the_exact_arm_is_exact():
    assert [m for m, a in ARMS.items() if a.exact] == ["exact"]
    for m, a in ARMS.items():  # every other arm whose trainer quantizes activations keeps the diagnostic record
        if not a.exact:
            assert arm_records(a, True)[1] == (a.trainer_mode in ("w4a4", "w4a4kv4"))
            assert not _method(m).exact
