"""TRACE guidance: records, byte accounting, replay. See trace/guidance/record.py and trace/qat/patch.py."""
from trace.guidance.record import SITES, GuidanceRecord, Recorder, RecordMismatch, SiteRows  # noqa: F401
