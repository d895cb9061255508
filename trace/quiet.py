"""Start-up noise of the command-line entry points, quieted: what asks nothing of the user.

transformers imports torchao whenever it is installed (it is, for the cross-check tests), and torchao then logs
that its CUDA-only extensions do not load and registers enums that torch reports as deprecated; wandb (a mirror of
metrics.jsonl) prints a banner unless WANDB_SILENT is set; progress bars (ours, transformers') redraw hundreds of
times into a log file, so they are off unless stderr is a terminal; DeepSpeed's "Setting accelerator to CPU"
warning on a machine without a GPU is dropped. An explicit WANDB_SILENT / TQDM_DISABLE in the environment wins.

`python -m trace.<command>` calls `quiet_startup` when the package is first imported (trace/__init__.py), before the
command's own imports log anything; importing `trace` as a library changes no environment variable and installs
no filter. A program of its own that wants the same calls `quiet_startup()` before importing transformers.
"""
from __future__ import annotations

import logging
import os
import sys


class DropMessages(logging.Filter):
    """Drops log records whose message contains one of `needles`."""

    def __init__(self, *needles: str):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in str(record.msg) for n in self.needles)


FILTERS = {
    "torchao": ("Failed to load",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    # DeepSpeed (imported by transformers and the OpenRLHF path) warns on every CPU start-up that it found no
    # accelerator; on a CPU machine that is the expected case, not something to act on
    "DeepSpeed": ("Setting accelerator to CPU",),
}


def quiet_startup() -> None:
    """Sets WANDB_SILENT (and TQDM_DISABLE off a terminal) unless already set, and installs the log filters of
    FILTERS once."""
    os.environ.setdefault("WANDB_SILENT", "true")
    if not (sys.stderr is not None and sys.stderr.isatty()):
        os.environ.setdefault("TQDM_DISABLE", "1")  # read by tqdm when it is first imported
    for name, needles in FILTERS.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in log.filters):
            log.addFilter(DropMessages(*needles))


def started_as_command(argv: list[str] | None = None) -> bool:
    """Whether the interpreter was started as `python [options] -m trace.<command>` (sys.orig_argv): the
    interpreter's own options come first; a script, `-c` or anything after them is not a trace command."""
    argv = list(sys.orig_argv if argv is None else argv)
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            return i + 1 < len(argv) and argv[i + 1].startswith("trace.")
        if a.startswith("-m"):
            return a[2:].startswith("trace.")
        if a in ("-X", "-W"):  # options with an argument
            i += 2
        elif a.startswith("-") and a not in ("-", "-c") and not a.startswith("-c"):
            i += 1
        else:
            return False
    return False
