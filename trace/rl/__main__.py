"""`python -m trace.rl --config CFG.yaml --out DIR [--set rl.method=trace ...]`: one RL run.

Writes DIR/config.yaml, meta.json, metrics.jsonl (one object per step), ckpt/ and `done`. Restarting
the same command after a crash resumes from the last checkpoint (see trace/rl/trainer.py).
Exit codes: 0 done, 2 bad config or inputs (one `error:` line; nothing written), 3 non-finite loss/logits (step not applied, checkpoint kept),
130 interrupted by Ctrl-C (one line: the step it stopped in and the step a rerun resumes from).
"""
from __future__ import annotations

import sys

from trace import config as C
from trace import rundir


def main(argv=None) -> int:
    p = C.base_parser("python -m trace.rl", "GRPO-style RL of a tiny MoE policy under one method arm.")
    p.add_argument("--out", required=True, help="run directory (created; resumed if it holds a checkpoint)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    a, cfg = C.parse_cli(p, argv)
    from trace.rl.trainer import NonFiniteError, run_rl
    try:
        run_rl(cfg, a.out, progress=not a.no_progress)
    except C.ConfigError as e:  # start-up: model, rl.init_ckpt, JSONL files, a different run in --out
        C.fail(e)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except rundir.Interrupted as e:
        return rundir.report_interrupt(e)
    except KeyboardInterrupt:  # before the loop (building the models, loading the SFT base)
        return rundir.report_interrupt(rundir.Interrupted(a.out, None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
