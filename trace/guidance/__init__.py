"""TRACE guidance, the method itself: record format and byte accounting (record.py), layer selection
(select.py), the per-site recording / replay runtime (replay.py), flip statistics (stats.py), the
alignment term (align.py) and an arm's method as the trainers use it (method.py: what to record, the
replay call, the weighted alignment term). Adapters (trace/qat, trace/rollout) call this API at their FP4
sites; the trainers (trace/rl, trace/integrations/openrlhf) hold a `Method`."""
from trace.guidance.align import MARGIN, alignment_loss, alignment_terms, scale_terms  # noqa: F401
from trace.guidance.method import Alignment, Method  # noqa: F401
from trace.guidance.record import SITES, GuidanceRecord, Recorder, RecordMismatch, SiteRows, Tee  # noqa: F401
from trace.guidance.replay import Recording, Replay, Rows, Runtime, recording, replay  # noqa: F401
from trace.guidance.select import arm_recorders, arm_records, guided_layer_indices  # noqa: F401
from trace.guidance.stats import LayerStats, ReplayStats  # noqa: F401
