"""Bootstrap intervals and paired comparisons (stats.py): hand-computed cases and their coverage."""

import numpy as np
import pytest

import stats


def test_constant_scores_have_a_zero_width_interval():
    assert stats.interval([[1.0] * 5, [1.0] * 3]) == (1.0, 1.0, 1.0)
    same = stats.paired_difference([[1, 0, 1]], [[1, 0, 1]])
    assert same == {"diff": 0.0, "low": 0.0, "high": 0.0, "p": 1.0}


def test_one_group_matches_the_normal_approximation():
    scores = [1.0] * 200 + [0.0] * 200  # mean 0.5, standard error sqrt(0.25 / 400) = 0.025
    mean, low, high = stats.interval([scores])
    assert mean == 0.5
    assert high - low == pytest.approx(2 * 1.96 * 0.025, rel=0.05)
    assert low < 0.5 < high


def test_seed_to_seed_spread_widens_the_interval():
    pooled = stats.interval([[1.0] * 90 + [0.0] * 10 + [1.0] * 10 + [0.0] * 90])
    by_seed = stats.interval([[1.0] * 90 + [0.0] * 10, [1.0] * 10 + [0.0] * 90])
    assert pooled[0] == by_seed[0] == 0.5
    assert by_seed[2] - by_seed[1] > 5 * (pooled[2] - pooled[1])  # two seeds that disagree: ~0.1..0.9


def test_paired_difference_sees_a_shift_that_unpaired_noise_hides():
    rng = np.random.default_rng(1)
    hard = rng.random(300) < 0.5           # per-problem difficulty shared by both arms
    a = hard.astype(float)
    b = a.copy()
    b[:30] = np.where(a[:30] == 1, 0.0, b[:30])  # B loses some problems A solves
    d = stats.paired_difference([a], [b])
    assert d["diff"] == pytest.approx((a - b).mean())
    assert 0 < d["low"] < d["diff"] < d["high"]
    assert d["p"] < 0.001
    assert stats.paired_difference([b], [a])["diff"] == pytest.approx(-d["diff"])


def test_no_difference_gives_a_large_p_value():
    rng = np.random.default_rng(2)
    a, b = (rng.random(200) < 0.4).astype(float), (rng.random(200) < 0.4).astype(float)
    d = stats.paired_difference([a], [b])
    assert d["low"] < 0 < d["high"] and d["p"] > 0.05


def test_coverage_of_the_95_interval_is_about_95_percent():
    rng = np.random.default_rng(3)
    hits = sum(lo <= 0.3 <= hi for _, lo, hi in
               (stats.interval([(rng.random(120) < 0.3).astype(float)], resamples=2000, seed=i) for i in range(200)))
    assert 0.89 <= hits / 200 <= 0.99


def test_mismatched_or_empty_inputs_are_refused():
    with pytest.raises(ValueError, match="group 0: 3 scores in A but 2 in B"):
        stats.paired_difference([[1, 0, 1]], [[1, 0]])
    with pytest.raises(ValueError, match="no empty group"):
        stats.interval([[1.0], []])


def test_median_ratio_interval_of_timings():
    """Constant timings give a zero-width interval at their ratio; noisy ones an interval around the ratio of
    medians that narrows with more measurements."""
    assert stats.median_ratio_interval([2.0] * 5, [1.0] * 7) == (2.0, 2.0)
    rng = np.random.default_rng(1)
    few = stats.median_ratio_interval(rng.normal(30, 3, 6), rng.normal(20, 2, 6))
    many = stats.median_ratio_interval(rng.normal(30, 3, 200), rng.normal(20, 2, 200))
    assert few[0] < 1.5 < few[1] and many[0] < 1.5 < many[1]
    assert many[1] - many[0] < (few[1] - few[0]) / 2


def test_t_quantiles_match_the_table():
    for df, table in [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (30, 2.042)]:
        assert stats.t_quantile(0.975, df) == pytest.approx(table, abs=5e-4)
    assert stats.t_quantile(0.95, 4) == pytest.approx(2.132, abs=5e-4)
    with pytest.raises(ValueError):
        stats.t_quantile(0.4, 3)


def test_seed_interval_by_hand():
    """Per-seed gains +0.160, -0.039, +0.207: mean 0.1093, s.d. 0.1305, t(2) 4.303 -> half-width 0.3242."""
    mean, low, high = stats.seed_interval([0.160, -0.039, 0.207])
    assert mean == pytest.approx(0.10933, abs=1e-5)
    assert (low, high) == (pytest.approx(-0.2151, abs=2e-4), pytest.approx(0.4337, abs=2e-4))
    with pytest.raises(ValueError, match="at least 2 seeds"):
        stats.seed_interval([0.1])
    d = stats.paired_seed_difference([[1, 0, 1, 1], [1, 1, 1, 0]], [[0, 0, 1, 0], [0, 0, 1, 0]])
    assert d["per_seed"] == [0.5, 0.5] and d["low"] == d["high"] == 0.5 and d["p"] == 0.0
    d = stats.paired_seed_difference([[1, 0], [0, 0], [1, 1]], [[0, 0], [0, 1], [1, 0]])
    # per seed +0.5, -0.5, +0.5: mean 1/6, s.d. 0.5774, t = 0.5 with df 2 -> two-sided p 0.6667
    assert d["diff"] == pytest.approx(1 / 6) and d["p"] == pytest.approx(2 / 3, abs=1e-4)


@pytest.mark.parametrize("seeds", [3, 5])
def test_the_interval_over_seeds_holds_its_level_by_simulation(seeds):
    """Two arms on the same 64 problems per seed, each seed shifting the true difference by N(0, 0.08) and
    each problem's verdicts drawn around it: the t interval of the per-seed differences covers the true mean
    difference in >= 93 % of 2,000 simulated comparisons (the level is 95 %)."""
    rng = np.random.default_rng(seeds)
    true, covered, trials = 0.05, 0, 2000
    for _ in range(trials):
        a, b = [], []
        for _ in range(seeds):
            shift = rng.normal(0, 0.08)
            p_b = rng.uniform(0.2, 0.6, size=64)
            p_a = np.clip(p_b + true + shift, 0, 1)
            a.append((rng.random(64) < p_a).astype(float))
            b.append((rng.random(64) < p_b).astype(float))
        d = stats.paired_seed_difference(a, b)
        covered += d["low"] <= true <= d["high"]
    assert covered / trials >= 0.93, covered / trials


def test_bootstrap_p_counts_replicates_at_zero_half_to_each_side():
    """B solves 2 of 8 problems A misses, nothing else differs: a replicate's mean difference is 0 exactly when
    it draws neither (probability (6/8)^8 = 0.100), else negative. Half the zeros go to each side: p = 0.100
    (counted on both sides, 0.200, which beside an interval ending at 0.000 reads as a contradiction)."""
    d = stats.paired_difference([[1, 0, 0, 0, 0, 0, 0, 0]], [[1, 1, 1, 0, 0, 0, 0, 0]])
    assert d["diff"] == -0.25 and d["high"] == 0.0
    assert d["p"] == pytest.approx(0.75 ** 8, abs=0.01)


def test_a_group_of_one_problem_is_a_group_and_group_counts_must_match():
    assert stats.interval([[1.0], [0.0, 1.0]])[0] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="^bootstrap needs at least one group and no empty group$"):
        stats.interval([[1.0], []])
    with pytest.raises(ValueError, match="^group 0: 3 scores in A but 2 in B; a paired comparison needs the same "
                                         "problems on both sides$"):
        stats.paired_difference([[1, 0, 1]], [[1, 0]])
    with pytest.raises(ValueError):  # two seeds' problems against one: not a pairing
        stats.paired_difference([[1, 0], [1, 1]], [[1, 0]])
    with pytest.raises(ValueError):
        stats.paired_seed_difference([[1, 0], [1, 1], [0, 0]], [[1, 0], [1, 1]])


def test_the_same_seed_gives_the_same_interval_and_another_seed_other_draws():
    """Reproducible: a result printed in a table can be recomputed exactly; the seed reaches the draws."""
    rng = np.random.default_rng(0)
    a, b = [rng.random(40).tolist() for _ in range(3)], [rng.random(40).tolist() for _ in range(3)]  # avg@k-like
    assert stats.interval(a) == stats.interval(a) and stats.interval(a, seed=3) != stats.interval(a)
    assert stats.paired_difference(a, b) == stats.paired_difference(a, b)
    assert stats.paired_difference(a, b, seed=3) != stats.paired_difference(a, b)
    slow, fast = rng.normal(10, 1, 10).tolist(), rng.normal(5, 1, 10).tolist()
    assert stats.median_ratio_interval(slow, fast) == stats.median_ratio_interval(slow, fast)
    assert stats.median_ratio_interval(slow, fast, seed=3) != stats.median_ratio_interval(slow, fast)


def test_bootstrap_p_counts_zeros_half_to_each_side_in_both_directions():
    """The mirror of the case above: A solves 2 of 8 problems B misses; p = (6/8)^8 again."""
    d = stats.paired_difference([[1, 1, 1, 0, 0, 0, 0, 0]], [[1, 0, 0, 0, 0, 0, 0, 0]])
    assert d["diff"] == 0.25 and d["low"] == 0.0
    assert d["p"] == pytest.approx(0.75 ** 8, abs=0.01)


def test_paired_seed_difference_level_and_constant_differences():
    """Every seed's difference the same: no spread, so the interval is that value and p is 0 (or 1 when it is
    0); a lower level gives a narrower interval."""
    same = stats.paired_seed_difference([[1, 0]] * 3, [[1, 0]] * 3)
    assert (same["diff"], same["low"], same["high"], same["p"]) == (0.0, 0.0, 0.0, 1.0)
    shifted = stats.paired_seed_difference([[1, 0]] * 3, [[0, 0]] * 3)
    assert (shifted["diff"], shifted["low"], shifted["high"], shifted["p"]) == (0.5, 0.5, 0.5, 0.0)
    a, b = [[1, 1, 0], [1, 0, 0], [1, 1, 1]], [[0, 1, 0], [1, 0, 0], [0, 0, 1]]
    wide, narrow = stats.paired_seed_difference(a, b), stats.paired_seed_difference(a, b, level=0.8)
    assert narrow["diff"] == wide["diff"] and wide["low"] < narrow["low"] < narrow["high"] < wide["high"]


def test_median_ratio_interval_is_the_2_5_and_97_5_percentiles():
    """Medians of resamples of an odd grid of values land on grid points: the 2.5th and 97.5th percentiles of
    the ratio are these grid points for every seed tried (0-4), and the 3.5th or 98.5th are others."""
    assert stats.median_ratio_interval(np.linspace(1, 3, 51), [1.0]) == pytest.approx((1.72, 2.28))
    assert stats.median_ratio_interval(np.linspace(1, 3, 41), [1.0]) == pytest.approx((1.70, 2.30))


def test_unpaired_difference_by_hand_and_by_simulation():
    """Two independent samples: the difference of means exactly (3/4 - 1/4), an interval and p from resampling
    each side alone, identical samples at p 1, empty sides refused; and at 40 rollouts a side the 95 % interval
    holds the true difference (0.3 - 0.1) in 0.93 to 0.98 of simulated cases."""
    d = stats.unpaired_difference([1, 1, 1, 0], [1, 0, 0, 0])
    assert d["diff"] == 0.5 and d["low"] < 0.5 < d["high"] and -1 <= d["low"] and d["high"] <= 1
    assert stats.unpaired_difference([1, 0] * 50, [0, 1] * 60)["p"] > 0.9
    assert stats.unpaired_difference([1] * 30, [0] * 30) == {"diff": 1.0, "low": 1.0, "high": 1.0, "p": 0.0}
    with pytest.raises(ValueError, match="scores on both sides, got 0 and 2"):
        stats.unpaired_difference([], [1, 0])
    rng = np.random.default_rng(5)
    hits = 0
    for i in range(300):
        a, b = (rng.random(40) < 0.3).astype(float), (rng.random(40) < 0.1).astype(float)
        d = stats.unpaired_difference(a, b, resamples=2000, seed=i)
        hits += d["low"] <= 0.2 <= d["high"]
    assert 0.93 <= hits / 300 <= 0.98
