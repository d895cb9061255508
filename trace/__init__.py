"""TRACE: rollout-guided QAT for FP4 RL of MoE language models (see README.md, docs/DESIGN.md).

Importing the package changes nothing in the process. Started as a command (`python -m trace.<command>`), it first
quiets start-up noise that asks nothing of the user (trace/quiet.py), before the command's imports emit it.
"""
import sys as _sys

if "-m" in _sys.orig_argv[1:]:  # cheap pre-check; trace.quiet decides
    from trace.quiet import quiet_startup as _quiet_startup
    from trace.quiet import started_as_command as _started_as_command

    if _started_as_command():
        _quiet_startup()
