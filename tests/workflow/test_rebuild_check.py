"""workflow/scripts/rebuild_check.py: a rebuilt SFT base is accepted only when its logged losses equal the
committed ones (or stay within an explicit relative tolerance), and the line says where they part."""
import json

from workflow.scripts.rebuild_check import compare, main


def test_bit_equal_is_the_default():
    assert compare([1.5, 1.25], [1.5, 1.25]) == (True, "identical (2 logged losses)")
    ok, why = compare([1.5, 1.25, 1.0], [1.5, 1.25 + 1e-7, 1.0])
    assert not ok and why.startswith("1 of 3 logged losses differ, first at line 2, largest relative difference 8e-08")


def test_a_tolerance_accepts_only_differences_inside_it():
    ok, why = compare([1.0, 2.0], [1.0, 2.0002], tol=1e-3)
    assert ok and why.startswith("within 0.001: 1 of 2")
    assert not compare([1.0, 2.0], [1.0, 2.01], tol=1e-3)[0]
    assert compare([1.0, 2.0], [1.0], tol=1.0) == (False, "2 losses logged, 1 rebuilt")


def test_cli_exit_status_and_line(tmp_path, capsys):
    for name, ls in (("a", [1.0, 0.5]), ("b", [1.0, 0.5]), ("c", [1.0, 0.6])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": x}) + "\n"
                                                               for i, x in enumerate(ls)))
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert main([str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    assert "not starting its runs" in capsys.readouterr().out
