"""Adapters that run TRACE inside other RL frameworks (OpenRLHF: `trace.integrations.openrlhf`).

They sit beside trace/qat and trace/rollout: they call the guidance API, the QAT adapter and the
rollout engine, and are never imported by them.
"""
