"""Mutation check of the test suite: each small, plausible bug below must make a test fail.

    .venv/bin/python scripts/mutations.py                  # every mutation; report on stdout
    .venv/bin/python scripts/mutations.py --out results/mutations.txt
    .venv/bin/python scripts/mutations.py --only rl-rloo-divisor fp4-e2m1-tie   # some of them
    .venv/bin/python scripts/mutations.py --list
    .venv/bin/python scripts/mutations.py --worktree       # the working tree's uncommitted edits too

Each mutation is (id, file, exact old text, new text, test files). The script copies the committed tree (HEAD; with
--worktree the working tree's files that git does not ignore) into a temporary directory, checks that the named
test files pass there unmutated, then for one mutation at a time replaces the old text (it must occur exactly once
in the file), runs `pytest -x -q` on that mutation's test files on the CPU (the Triton kernels under
TRITON_INTERPRET=1, as tests/conftest.py sets), restores the file, and prints whether a test failed (caught) or
all passed (missed).

Exit status 1 if any mutation is missed, if its old text is not found exactly once (so an edit of the source cannot
silently retire a mutation), if a mutated run ends other than with failing tests (an import error, no tests
collected), or if the unmutated baseline fails. It runs on demand, not in CI (a few minutes on 2 cores); its last
report is results/mutations.txt.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str


M = Mutation
MUTATIONS: tuple[Mutation, ...] = (
    # ---------------------------------------------------------------- FP4 formats (kernels/reference.py)
    M("fp4-e2m1-tie", "kernels/reference.py",
      "idx += (a >= m if i % 2 else a > m).to(torch.uint8)",
      "idx += (a > m).to(torch.uint8)",
      ("tests/fp4/test_formats.py",),
      "E2M1 ties always round down instead of to the even code"),
    M("fp4-guided-clamp", "kernels/reference.py",
      "lo = e2m1_floor_index(a).clamp_(max=6)  # uint8",
      "lo = e2m1_floor_index(a).clamp_(max=7)  # uint8",
      ("tests/fp4/test_formats.py",),
      "guided rounding's lower grid point may be the top code 7 (6.0): a value above 6 with bit 0 becomes code 8"),
    M("fp4-outer-scale", "kernels/reference.py",
      "s = torch.full_like(amax, E2M1_MAX * E4M3_MAX) / amax.clamp(min=AMAX_MIN)",
      "s = torch.full_like(amax, E2M1_MAX * 256.0) / amax.clamp(min=AMAX_MIN)",
      ("tests/fp4/test_formats.py",),
      "NVFP4 outer scale S_enc = 6 * 256 / amax instead of 6 * 448 / amax"),
    M("fp4-pack-order", "kernels/reference.py",
      "return c[..., 0] | (c[..., 1] << 4)",
      "return c[..., 1] | (c[..., 0] << 4)",
      ("tests/fp4/test_formats.py",),
      "two codes per byte packed high nibble first"),
    # ---------------------------------------------------------------- guidance
    M("guidance-zero-sign-flip", "trace/guidance/replay.py",
      "return (a != b) & ((a | b) & 7 != 0)",
      "return a != b",
      ("tests/guidance/test_replay.py",),
      "-0 against +0 counted as a code flip"),
    M("guidance-record-verify", "trace/guidance/replay.py",
      "        rt.replaying.verify()  # every lookup of the block found its row (one host sync)",
      "        pass",
      ("tests/guidance/test_record.py",),
      "a replay block no longer checks that every lookup found its recorded row"),
    M("guidance-replay-is-rtn", "trace/guidance/replay.py",
      "guided_vals = fp4.straight_through(xv, vals)",
      "guided_vals = rows.select(rtn)",
      ("tests/guidance/test_replay.py",),
      "guided sites return the trainer's own RTN instead of the rollout's quantization"),
    M("guidance-ratio-bound", "trace/guidance/mismatch.py",
      '"ratio_out_frac": float(((r < 0.5) | (r > 2.0)).double().mean()),',
      '"ratio_out_frac": float(((r < 0.5) | (r > 4.0)).double().mean()),',
      ("tests/guidance/test_mismatch.py",),
      "ratio-outside bound 2 -> 4"),
    M("guidance-hinge-direction", "trace/guidance/align.py",
      "d = torch.where(up, a - edge, edge - a) / gap  # > 0 inside the target's interval",
      "d = torch.where(up, edge - a, a - edge) / gap  # > 0 inside the target's interval",
      ("tests/guidance/test_align.py",),
      "the alignment hinge measures the distance on the wrong side of the boundary"),
    # ---------------------------------------------------------------- RL losses
    M("rl-k3-direction", "trace/rl/losses.py",
      "lr = (log_probs.float() - ref_log_probs.float()).clamp(min=-10)",
      "lr = (ref_log_probs.float() - log_probs.float()).clamp(min=-10)",
      ("tests/rl/test_losses.py",),
      "k3 KL estimated as KL(ref || pi) instead of KL(pi || ref)"),
    M("rl-rloo-divisor", "trace/rl/losses.py",
      "out = r - (r.sum(-1, keepdim=True) - r) / (group_size - 1)",
      "out = r - (r.sum(-1, keepdim=True) - r) / group_size",
      ("tests/rl/test_losses.py",),
      "RLOO baseline divides the others' sum by the group size instead of group size - 1"),
    M("rl-is-old-ignored", "trace/rl/losses.py",
      "is_src = old_log_probs if is_old_log_probs is None else is_old_log_probs",
      "is_src = old_log_probs",
      ("tests/rl/test_losses.py",),
      "is_old_log_probs ignored: with rl.ppo_ratio=rollout the TIS / ICEPOP weight is exactly 1"),
    M("rl-tis-uncapped", "trace/rl/losses.py",
      "coef = is_ratio.clamp(min=0.0, max=tis_cap)",
      "coef = is_ratio.clamp(min=0.0)",
      ("tests/rl/test_losses.py",),
      "TIS weight not capped"),
    M("rl-clip-upper", "trace/rl/losses.py",
      "surr2 = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages",
      "surr2 = ratio.clamp(1 - clip_eps, 1 + 2 * clip_eps) * advantages",
      ("tests/rl/test_losses.py",),
      "PPO clip range's upper end 1 + 2 eps"),
    M("rl-group-norm-std", "trace/rl/losses.py",
      "out = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)",
      "out = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True, correction=0) + 1e-9)",
      ("tests/rl/test_losses.py",),
      "group_norm divides by the biased std (OpenRLHF uses the unbiased one)"),
    # ---------------------------------------------------------------- tasks
    M("tasks-unicode-digits", "trace/tasks/reasoning.py",
      "if not body or not body.isascii() or not body.isdigit():",
      "if not body or not body.isdigit():",
      ("tests/tasks/test_reasoning.py",),
      "the arithmetic verifier accepts non-ASCII digits"),
    M("tasks-precedence", "trace/tasks/reasoning.py",
      'if op == "*":\n            terms[-1] *= v',
      'if op == "/":\n            terms[-1] *= v',
      ("tests/tasks/test_reasoning.py",),
      "the gold answer's * no longer binds tighter than + and -"),
    M("tasks-feedback-direction", "trace/tasks/long_horizon.py",
      'word = "higher" if s["secret"] > guess else "lower"',
      'word = "higher" if s["secret"] < guess else "lower"',
      ("tests/tasks/test_long_horizon.py",),
      "the guessing game's feedback points the wrong way"),
)


def copy_repo(dst: Path, worktree: bool) -> None:
    """The committed tree (HEAD), or with `worktree` the working tree's files that git does not ignore (tracked files
    with their uncommitted edits, new files)."""
    if not worktree:
        tar = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dst)], input=tar.stdout, check=True)
        return
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    for rel in out.decode().split("\0"):
        src = ROOT / rel
        if rel and src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def run_tests(tmp: Path, tests, timeout: float) -> tuple[int | None, float, str]:
    """pytest -x -q on `tests` in the copy -> (exit status or None on timeout, seconds, the output's tail)."""
    env = dict(os.environ, PYTHONPATH=str(tmp), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        rc, tail = r.returncode, (r.stdout + r.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        rc, tail = None, ""
    return rc, time.perf_counter() - t0, tail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", metavar="ID", help="run these mutations only")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run (default 600)")
    ap.add_argument("--out", type=Path, help="also write the report to this file")
    ap.add_argument("--worktree", action="store_true",
                    help="mutate a copy of the working tree (uncommitted edits included) instead of HEAD")
    args = ap.parse_args(argv)
    muts = MUTATIONS
    if args.only:
        unknown = set(args.only) - {m.id for m in MUTATIONS}
        if unknown:
            ap.error(f"unknown mutation ids: {sorted(unknown)}")
        muts = tuple(m for m in MUTATIONS if m.id in args.only)
    if args.list:
        for m in muts:
            print(f"{m.id:28s} {m.file}: {m.why}  [{' '.join(m.tests)}]")
        return 0

    lines: list[str] = []

    def say(s: str) -> None:
        lines.append(s)
        print(s, flush=True)

    t_start = time.perf_counter()
    bad = []
    with tempfile.TemporaryDirectory(prefix="mutations-") as d:
        tmp = Path(d)
        copy_repo(tmp, args.worktree)
        tests = sorted({t for m in muts for t in m.tests})
        rc, secs, tail = run_tests(tmp, tests, args.timeout)
        if rc != 0:
            say(f"baseline: the unmutated test files do not pass (pytest exit {rc}, {secs:.0f} s): {' '.join(tests)}")
            print(tail, file=sys.stderr)
            return 1
        say(f"baseline: {len(tests)} test files pass unmutated ({secs:.0f} s)")
        for m in muts:
            path = tmp / m.file
            text = path.read_text()
            n = text.count(m.old)
            if n != 1:
                say(f"NOT FOUND  {m.id}: {m.file}: old text occurs {n} times (must be once): {m.old!r}")
                bad.append(m.id)
                continue
            path.write_text(text.replace(m.old, m.new))
            try:
                rc, secs, tail = run_tests(tmp, m.tests, args.timeout)
            finally:
                path.write_text(text)
            verdict = {0: "MISSED", 1: "caught"}.get(rc, "timeout" if rc is None else f"ERROR (pytest exit {rc})")
            if rc != 1:
                bad.append(m.id)
                if rc not in (0, None):
                    print(tail, file=sys.stderr)
            say(f"{verdict:10s} {m.id}: {m.file}: {m.why} ({secs:.0f} s; {' '.join(m.tests)})")
    caught = len(muts) - len(bad)
    say(f"summary: caught {caught} of {len(muts)} mutations in {time.perf_counter() - t_start:.0f} s"
        + (f"; not caught: {' '.join(bad)}" if bad else ""))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
