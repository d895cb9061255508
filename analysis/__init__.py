"""Logged runs -> tables. ``python -m analysis.tables --runs results/runs/smoke --out results/tables/smoke``.

analysis.runs reads run dirs (config.yaml, metrics.jsonl, eval.json, done) into per-run summaries;
analysis.tables turns them into the main and ablation tables (CSV + Markdown).
"""
