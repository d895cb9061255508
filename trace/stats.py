"""Standard errors of accuracies measured over clustered examples, one implementation for the evaluation
(trace/episode.py, eval.json's `se`) and the tables (analysis/): plain numpy, so the analysis imports no torch.

`clustered_se`: one evaluation's SE, clustered by prompt. `two_way_se`: the SE of a mean over K seeds whose
evaluations score the same prompts (an arm's accuracy, or a seed-paired difference of two arms): a prompt's
difficulty recurs in every seed, so its part of the variance does not shrink with K."""
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


def two_way_se(x, cluster=None):
    """(mean, SE) of per-prompt values x [..., K seeds, N prompts] that score the same prompts in every seed
    (`cluster`: the prompts' clusters, None: each its own); vectorized over the leading axes. The variance is that
    of a two-way layout whose prompts are shared by every seed:
      * the prompt component: the squared clustered SE of the seed-averaged per-prompt values mean_k x[k, i] (it
        holds the prompts' own spread and the within-seed evaluation noise, / K);
      * the seed component: the variance over seeds of the per-seed means mean_i x[k, i], less the part of it the
        evaluation noise explains (the seeds' mean squared clustered SE of the prompt-by-seed residuals, times
        K / (K - 1); an unbiased estimate, floored at 0), / K.
    K = 1: the prompt component alone (that evaluation's clustered SE)."""
    x = np.asarray(x, dtype=float)
    k = x.shape[-2]
    per_prompt, per_seed = x.mean(-2), x.mean(-1)  # [..., N], [..., K]
    var = clustered_se(per_prompt, cluster) ** 2  # the prompt component
    if k > 1:
        resid = x - per_prompt[..., None, :] - per_seed[..., :, None] + per_seed.mean(-1)[..., None, None]
        noise = k / (k - 1) * np.mean(clustered_se(resid, cluster) ** 2, axis=-1)  # a seed mean's evaluation noise
        var = var + np.maximum(np.var(per_seed, axis=-1, ddof=1) - noise, 0.0) / k  # the seed component
    return per_seed.mean(-1), np.sqrt(var)
