"""The standard error of an accuracy measured over clustered examples, one implementation for the evaluation
(trace/episode.py, eval.json's `se`) and the tables (analysis/): plain numpy, so the analysis imports no torch."""
from __future__ import annotations

import math

import numpy as np


def clustered_se(per_prompt, cluster=None) -> float:
    """Standard error of the mean of per-example accuracies (equal samples per example) whose examples are
    grouped in clusters (`cluster[i]`: example i's cluster, e.g. the prompt a task's examples share; None: every
    example its own cluster), the cluster-robust (CR1) formula sqrt(C / (C - 1) * sum_c (sum_{i in c}
    (p_i - mean))^2) / N. Samples of one cluster are correlated, so a binomial SE over samples, or one over
    examples when clusters hold several, would understate it. With one example per cluster it is
    sd(p) / sqrt(N). NaN for fewer than two clusters."""
    p = np.asarray(per_prompt, dtype=float)
    if cluster is None:
        return float(np.std(p, ddof=1) / math.sqrt(p.size)) if p.size > 1 else math.nan
    ids = np.asarray(cluster, dtype=int)
    if ids.size != p.size:
        raise ValueError(f"{ids.size} cluster ids for {p.size} examples")
    c = np.unique(ids).size
    if c < 2:
        return math.nan
    sums = np.bincount(ids, weights=p - p.mean())
    return float(math.sqrt(c / (c - 1) * np.sum(sums**2)) / p.size)
