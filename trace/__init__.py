"""TRACE: rollout-guided QAT for FP4 RL of MoE language models (see README.md, docs/DESIGN.md).

Importing the package only quiets start-up noise that asks nothing of the user: transformers imports
torchao whenever it is installed (it is, for the cross-check tests), and torchao then logs that its
CUDA-only extensions do not load and registers enums that torch reports as deprecated; wandb (a mirror
of metrics.jsonl) prints a banner unless WANDB_SILENT is set; progress bars (ours, transformers')
redraw hundreds of times into a log file, so they are off unless stderr is a terminal; DeepSpeed's
"Setting accelerator to CPU" warning on a machine without a GPU is dropped. An explicit
WANDB_SILENT / TQDM_DISABLE in the environment wins.
"""
import logging as _logging
import os as _os
import sys as _sys

_os.environ.setdefault("WANDB_SILENT", "true")
if not (_sys.stderr is not None and _sys.stderr.isatty()):
    _os.environ.setdefault("TQDM_DISABLE", "1")  # read by tqdm when it is first imported


class _Drop(_logging.Filter):
    def __init__(self, *needles: str):
        super().__init__()
        self.needles = needles

    def filter(self, record: _logging.LogRecord) -> bool:
        return not any(n in str(record.msg) for n in self.needles)


_logging.getLogger("torchao").addFilter(_Drop("Failed to load"))
_logging.getLogger("torch.utils._pytree").addFilter(_Drop("is an Enum subclass and is now natively supported"))
# DeepSpeed (imported by transformers and the OpenRLHF path) warns on every CPU start-up that it found no
# accelerator; on a CPU machine that is the expected case, not something to act on
_logging.getLogger("DeepSpeed").addFilter(_Drop("Setting accelerator to CPU"))
