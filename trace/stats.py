"""The standard error of an accuracy measured over clustered examples, one implementation for the evaluation
(trace/episode.py, eval.json's `se`) and the tables (analysis/): plain numpy, so the analysis imports no torch."""
from __future__ import annotations

import math

import numpy as np


def clustered_se(per_prompt, cluster=None):
    """Standard error of the mean of per-example accuracies (equal samples per example) whose examples are
    grouped in clusters (`cluster[i]`: example i's cluster, e.g. the prompt a task's examples share; None: every
    example its own cluster), the cluster-robust (CR1) formula sqrt(C / (C - 1) * sum_c (sum_{i in c}
    (p_i - mean))^2) / N. Samples of one cluster are correlated, so a binomial SE over samples, or one over
    examples when clusters hold several, would understate it. With one example per cluster it is
    sd(p) / sqrt(N). NaN for fewer than two clusters. `per_prompt` is [N] (a float back) or [..., N] (an array
    of the leading shape back: each row's SE, the same clusters for every row)."""
    p = np.asarray(per_prompt, dtype=float)
    n = p.shape[-1]
    if cluster is None:
        se = np.std(p, axis=-1, ddof=1) / math.sqrt(n) if n > 1 else np.full(p.shape[:-1], math.nan)
    else:
        ids = np.asarray(cluster, dtype=int)
        if ids.size != n:
            raise ValueError(f"{ids.size} cluster ids for {n} examples")
        c = np.unique(ids).size
        if c < 2:
            se = np.full(p.shape[:-1], math.nan)
        else:
            rows = (p - p.mean(-1, keepdims=True)).reshape(-1, n)
            bins = int(ids.max()) + 1
            sums = np.bincount((ids + bins * np.arange(len(rows))[:, None]).ravel(), weights=rows.ravel(),
                               minlength=bins * len(rows)).reshape(len(rows), bins)  # each row's sum per cluster id
            se = (np.sqrt(c / (c - 1) * np.sum(sums**2, axis=1)) / n).reshape(p.shape[:-1])
    return float(se) if p.ndim == 1 else se
