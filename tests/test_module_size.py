"""No module of the package (trace/, kernels/, benchmarks/) is over LIMIT lines: a longer one is split by what
it does (the rollout engine's decode loops in trace/rollout/decode.py, the kernel benchmark's parts in
benchmarks/kernel_bench/, the decode GEMV in kernels/gemv.py, the code sandbox's kernel boundary and child
program in trace/tasks/sandbox_kernel.py and trace/tasks/sandbox_child.py)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 600


def _lines() -> dict[str, int]:
    files = [p for d in ("trace", "kernels", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}


def test_no_module_is_over_the_limit():
    lines = _lines()
    assert len(lines) > 50
    over = {m: n for m, n in lines.items() if n > LIMIT}
    assert over == {}, f"modules over {LIMIT} lines: {over}"

