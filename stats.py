"""Uncertainty for accuracies: bootstrap intervals over problems (and seeds), paired differences with a
p-value. Used by evaluate.py (summary.md, --compare), plot.py (bands over seeds) and bench/learning.py.
`median_ratio_interval` does the same for timings (bench/: step times, tokens per second).

Every function takes per-problem scores (a verdict, avg@k over k samples, ...); `groups` are independent
sets of problems, e.g. one per training seed, and the bootstrap resamples the groups, then the problems
within each resampled group (a two-level bootstrap: seed-to-seed and problem-to-problem noise both count).
"""

from __future__ import annotations

import functools

import numpy as np

RESAMPLES = 10_000


def bootstrap_means(groups: list[list[float]] | list[np.ndarray], resamples: int = RESAMPLES,
                    seed: int = 0) -> np.ndarray:
    """`resamples` bootstrap replicates of the mean score over all problems of all groups."""
    arrays = [np.asarray(g, dtype=np.float64) for g in groups]
    if not arrays or any(a.size == 0 for a in arrays):
        raise ValueError("bootstrap needs at least one group and no empty group")
    rng = np.random.default_rng(seed)
    picked_groups = rng.integers(0, len(arrays), size=(resamples, len(arrays)))
    total = np.zeros(resamples)
    count = np.zeros(resamples)
    for g, a in enumerate(arrays):
        times = (picked_groups == g).sum(axis=1)  # how often group g was drawn in each replicate
        for t in np.unique(times[times > 0]):
            rows = np.flatnonzero(times == t)
            chunk = max(1, 2_000_000 // (t * a.size))  # replicates per draw: bounded memory for big benchmarks
            for start in range(0, rows.size, chunk):
                part = rows[start:start + chunk]
                # t independent draws of the group, each a resample of its problems
                total[part] += a[rng.integers(0, a.size, size=(part.size, t, a.size))].sum(axis=(1, 2))
                count[part] += t * a.size
    return total / count


def _percentile_interval(arrays: list[np.ndarray], level: float, resamples: int,
                         seed: int) -> tuple[float, float, float, np.ndarray]:
    """(mean, low, high, the bootstrap replicates of the mean) over all scores of all groups."""
    means = bootstrap_means(arrays, resamples, seed)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(np.concatenate(arrays).mean()), float(low), float(high), means


def interval(groups, level: float = 0.95, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean score and its percentile-bootstrap interval."""
    return _percentile_interval([np.asarray(g, dtype=np.float64) for g in groups], level, resamples, seed)[:3]


def paired_differences(a_groups, b_groups) -> list[np.ndarray]:
    """A - B per group, problem by problem (position i of a group in A and in B is one problem)."""
    diffs = []
    for g, (a, b) in enumerate(zip(a_groups, b_groups, strict=True)):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            raise ValueError(f"group {g}: {a.size} scores in A but {b.size} in B; a paired comparison needs "
                             "the same problems on both sides")
        diffs.append(a - b)
    return diffs


def paired_difference(a_groups, b_groups, level: float = 0.95, resamples: int = RESAMPLES,
                      seed: int = 0) -> dict[str, float]:
    """A - B on the same problems (position i of a group in A and in B is one problem): the mean difference,
    its interval, and the two-sided bootstrap p-value of "no difference" from the same replicates (twice the
    smaller share on either side of 0, at most 1). Replicates at exactly 0 count half to each side: on a few
    problems many land there, and counting them on both sides gave p 0.67 beside an interval [-0.375, 0.000]."""
    diff, low, high, means = _percentile_interval(paired_differences(a_groups, b_groups), level, resamples, seed)
    return {"diff": diff, "low": low, "high": high, "p": _two_sided_p(means)}


def _two_sided_p(means: np.ndarray) -> float:
    """Bootstrap p-value of "no difference" from replicates of a difference: twice the smaller share on either
    side of 0, at most 1, replicates at exactly 0 counted half to each side."""
    ties = np.mean(means == 0) / 2
    return float(min(1.0, 2 * min(np.mean(means < 0) + ties, np.mean(means > 0) + ties)))


def unpaired_difference(a: list[float], b: list[float], level: float = 0.95, resamples: int = RESAMPLES,
                        seed: int = 0) -> dict[str, float]:
    """mean(A) - mean(B) of two independent samples (different rollouts, not the same problems on both sides):
    the difference, its percentile interval from resampling each side on its own, and the two-sided p-value
    of "no difference" counted as paired_difference counts it. Holds resamples x (len(A) + len(B)) draws in
    memory at once: meant for hundreds to thousands of scores, not a benchmark's millions."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.size == 0 or b.size == 0:
        raise ValueError(f"an unpaired difference needs scores on both sides, got {a.size} and {b.size}")
    rng = np.random.default_rng(seed)
    means = (a[rng.integers(0, a.size, size=(resamples, a.size))].mean(axis=1)
             - b[rng.integers(0, b.size, size=(resamples, b.size))].mean(axis=1))
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return {"diff": float(a.mean() - b.mean()), "low": float(low), "high": float(high), "p": _two_sided_p(means)}


def t_two_sided_tail(t: float, df: int) -> float:
    """P(|T| >= t) for Student's t with df degrees of freedom: I_x(df/2, 1/2) at x = df / (df + t^2), through
    mpmath (which math-verify's sympy brings)."""
    import mpmath

    return float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))


@functools.lru_cache(maxsize=256)
def t_quantile(q: float, df: int) -> float:
    """The q-quantile of Student's t with df degrees of freedom (q > 0.5): where 1 - P(|T| >= t) / 2 = q."""
    if not 0.5 < q < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < q < 1 and df >= 1, got q={q}, df={df}")
    low, high = 0.0, 1e4  # the CDF rises monotonically: bisect
    for _ in range(200):
        mid = (low + high) / 2
        if 1 - t_two_sided_tail(mid, df) / 2 < q:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def seed_interval(per_seed: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of per-seed values (each seed's accuracy, or its paired difference): the t interval
    over seeds, df = seeds - 1. Seeds are the independent units of a training comparison; with 3 of them the
    normal quantile 1.96 in place of t covers 0.81 in tests/test_stats.py's simulation, this interval >= 0.93."""
    x = np.asarray(per_seed, dtype=np.float64)
    if x.size < 2:
        raise ValueError(f"an interval over seeds needs at least 2 seeds, got {x.size}")
    half = t_quantile(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)
    return float(x.mean()), float(x.mean() - half), float(x.mean() + half)


def paired_seed_difference(a_groups, b_groups, level: float = 0.95) -> dict[str, float]:
    """A - B over seeds: each seed's mean difference on its problems (paired, as paired_difference), then the
    t interval over those per-seed differences and the two-sided t-test p-value of "no difference"."""
    per_seed = [float(d.mean()) for d in paired_differences(a_groups, b_groups)]
    diff, low, high = seed_interval(per_seed, level)
    x = np.asarray(per_seed)
    se = x.std(ddof=1) / np.sqrt(x.size)
    p = (1.0 if diff == 0 else 0.0) if se == 0 else t_two_sided_tail(abs(diff) / se, x.size - 1)
    return {"diff": diff, "low": low, "high": high, "p": p, "per_seed": per_seed}


def median_ratio_interval(a: list[float], b: list[float], draws: int = RESAMPLES,
                          seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of median(a) / median(b), resampling each side's measurements."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a), np.asarray(b)
    ratios = [np.median(rng.choice(a, a.size)) / np.median(rng.choice(b, b.size)) for _ in range(draws)]
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def fmt(mean: float, low: float, high: float) -> str:
    """0.453 [0.391, 0.516]"""
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def fmt_diff(d: dict[str, float]) -> str:
    """+0.051 [+0.012, +0.090]"""
    return f"{d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
