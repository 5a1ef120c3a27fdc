"""Training with the real loop teaches: on the tiny random model, the mean training reward climbs from where
it starts to a high level within a few dozen steps, for plain GRPO under each --loss-type and for LANPO.

The task, learnable by a 2-layer random model in seconds: the reward is the share of the response's
characters that are digits (the model starts near 0.04; lr 1e-2 takes it past 0.9 in about 30 steps).
These tests fail when the sign of the advantage in grpo.group_advantages is flipped (checked by hand: the
reward then falls towards 0), so they watch the sign, the completion mask and the normalisers end to end,
not only that the loop runs."""

import json
import sys
from pathlib import Path

import pytest

import config
import lanpo
import math_grader

STEPS = 40


def digit_share(response: str, gold: str, timeout: float = 5.0, truncated: bool = False) -> float:
    return sum(ch.isdigit() for ch in response) / max(len(response), 1)


def _rewards(tiny_model_dir, tmp_path, *extra) -> list[float]:
    out = tmp_path / "run"
    lanpo.main(config.parse_config([
        "--model", str(tiny_model_dir), "--out-dir", str(out), "--steps", str(STEPS), "--batch-problems", "4",
        "--group-size", "8", "--micro-batch", "32", "--max-new-tokens", "8", "--synthetic-size", "8",
        "--eval-every", "0", "--lr", "1e-2", "--report-to", "none", "--no-final-checkpoint", *extra]))
    return [json.loads(line)["reward_mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_learns(rewards: list[float]) -> None:
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert start < 0.3, rewards
    assert end > 0.8 and end > start + 0.5, rewards


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_grpo_learns_under_each_loss_type(tiny_model_dir, tmp_path, monkeypatch, loss_type):
    monkeypatch.setattr(math_grader, "grade", digit_share)
    _assert_learns(_rewards(tiny_model_dir, tmp_path, "--feedback", "none", "--loss-type", loss_type))


def test_lanpo_learns_with_feedback_both(tiny_model_dir, tmp_path, monkeypatch):
    """As GRPO, and through feedback: both kinds of feedback rollout are made, take part in the groups, and
    climb as the from-scratch ones do (fails on a run whose feedback never fires, or whose feedback rollouts
    do not learn)."""
    monkeypatch.setattr(math_grader, "grade", digit_share)
    _assert_learns(_rewards(tiny_model_dir, tmp_path, "--feedback", "both", "--relevance-threshold", "0",
                            "--abstract-max-tokens", "8"))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for kind in ("reflect", "abstract"):
        made = [r for r in records if r[f"{kind}/count"] > 0]
        assert sum(r[f"{kind}/count"] for r in made) >= 40, kind
        late = [r[f"{kind}/reward"] for r in made[-5:]]
        assert sum(late) / len(late) > 0.8, (kind, late)


def test_learning_bench_reuses_a_result_only_under_the_flags_that_made_it(tmp_path):
    """bench/learning.py's cache: a finished result is reused when the settings match, also under other
    memory-only settings; a result made with another setting, or recording no flags, stops the bench."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import learning

    path, calls = tmp_path / "grpo/seed0.json", []
    flags = ["--feedback", "none", "--lr", "1e-4", "--seed", "0"]
    assert learning.cached(path, lambda: calls.append(1) or {"verdicts": [1.0]}, flags) == {
        "verdicts": [1.0], "flags": flags}
    again = learning.cached(path, lambda: calls.append(1) or {}, flags + ["--micro-batch", "4", "--gen-batch", "8"])
    assert again["verdicts"] == [1.0] and calls == [1]  # computed once, reused under memory-only changes
    with pytest.raises(SystemExit, match=r"other settings \(seed, lr\)"):
        learning.cached(path, dict, ["--feedback", "none", "--lr", "2e-4", "--seed", "1"])
    with pytest.raises(SystemExit, match=r"other settings \(abstract_from\)"):
        learning.cached(path, dict, flags + ["--abstract-from", "solved"])
    path.write_text(json.dumps({"verdicts": [1.0]}))
    with pytest.raises(SystemExit, match="does not record the flags"):
        learning.cached(path, dict, flags)


def test_learning_bench_shows_each_seeds_difference_beside_the_interval_over_seeds():
    """Seed 0: 2 of 2 against 1 of 2 (+0.5); seed 1: 1 of 2 against 2 of 2 (-0.5): the t interval over two
    seeds says little, each seed's value says which way each went. One seed shows no list."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import learning

    import stats

    two = stats.paired_seed_difference([[1, 1], [0, 1]], [[0, 1], [1, 1]])
    assert learning.per_seed(two) == " (seeds +0.500, -0.500)"
    assert learning.per_seed(stats.paired_difference([[1, 1]], [[0, 1]])) == ""


def test_an_arms_flags_win_over_the_common_ones():
    """lanpo-gamma0 is the arm without a relevance filter even when the common flags filter (γ 0.5, the best
    candidate kept), and the bench says which common flags it set again; arms that share no flag with the
    common ones run exactly those flags."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import learning

    import config

    common = ["--relevance-threshold", "0.5", "--relevance-top", "1", "--lr", "1e-4"]
    cfg = config.parse_config(learning.arm_flags("lanpo-gamma0", common, 3))
    assert (cfg.relevance_threshold, cfg.relevance_top, cfg.lr, cfg.seed, cfg.feedback) == (0.0, 0, 1e-4, 3, "both")
    assert learning.overridden("lanpo-gamma0", common) == ["--relevance-threshold", "--relevance-top"]
    assert learning.overridden("grpo", common) == []
    solved = config.parse_config(learning.arm_flags("lanpo-solved-gamma0", common, 0))
    assert (solved.abstract_from, solved.relevance_threshold, solved.relevance_top) == ("solved", 0.0, 0)
    # the oracle arm under the rules-menu pilot's common gamma 0: its threshold wins, so a 0-scored candidate of
    # another family is never kept (at gamma 0 config refuses the family judge)
    oracle = config.parse_config(learning.arm_flags("lanpo-solved-oracle", ["--dataset", "synthetic:rules-menu",
                                                                              "--relevance-threshold", "0",
                                                                              "--relevance-top", "1"], 0))
    assert (oracle.relevance_judge, oracle.relevance_threshold, oracle.relevance_top) == ("family", 0.5, 1)


def test_learning_bench_reports_from_its_results_folder_alone(tmp_path, monkeypatch, capsys):
    """bench/results/ keeps each seed's JSON, not its run folder: the bench's table and curves come from the
    JSONs alone. Two seeds, rewards 0.25 and 0.75 then 0.5 and 1.0 (areas 0.5 and 0.75, mean 0.625); a rerun
    computes nothing; a result that lacks its run's metrics stops the bench naming the file."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import learning

    calls = []
    rewards = {0: [0.25, 0.75], 1: [0.5, 1.0]}

    def fake_run(name, seed, common, rows, cfg, run_dir):
        calls.append((name, seed))
        return {"verdicts": [1.0] * len(rows), "train_s": 60.0,
                "metrics": [{"step": i + 1, "reward_mean": r} for i, r in enumerate(rewards[seed])]}

    monkeypatch.setattr(learning, "train_and_evaluate", fake_run)
    monkeypatch.setattr(learning, "verdicts", lambda model, rows, cfg: [0.0] * len(rows))
    argv = ["learning.py", "--arms", "grpo", "--seeds", "0", "1", "--eval-size", "4", "--out-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    learning.main()
    first = capsys.readouterr().out
    assert calls == [("grpo", 0), ("grpo", 1)]
    assert "| grpo | 1.000 [1.000, 1.000] | +1.000" in first and "| 0.625 [" in first
    assert not (tmp_path / "grpo" / "seed0").exists() and (tmp_path / "learning.png").exists()
    learning.main()
    assert calls == [("grpo", 0), ("grpo", 1)] and capsys.readouterr().out == first
    result = json.loads((tmp_path / "grpo/seed1.json").read_text())
    del result["metrics"]
    (tmp_path / "grpo/seed1.json").write_text(json.dumps(result))
    with pytest.raises(SystemExit, match="grpo/seed1.json does not hold its run's metrics"):
        learning.main()


def test_learning_bench_counts_each_channels_rollouts_against_scratch_in_the_same_steps():
    """bench/learning.py's channel table, by hand: seed 0 has abstraction in step 2 only (4 rollouts, 1 right;
    scratch 4, 3 right) and reflection never; seed 1 has abstraction in both steps (2 of 4, then 0 of 4; scratch
    1 of 4, 1 of 4). Step 1 of seed 0 (no abstraction) is left out; pooled 3/12 against 5/12; per seed -0.500 and
    +0.000; judge precision 0.25 to 1.00 over the steps that have it; reflection says it never fired; GRPO has
    no row."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import learning

    def step(n, abstract, abstract_right, scratch_right, precision=None):
        r = {"step": n, "scratch/count": 4.0, "scratch/accuracy": scratch_right / 4, "reflect/count": 0.0,
             "abstract/count": float(abstract)}
        if abstract:
            r["abstract/accuracy"] = abstract_right / abstract
        if precision is not None:
            r["relevance_precision"] = precision
        return r

    final = {"grpo": {0: {"metrics": [step(1, 0, 0, 2)]}, 1: {"metrics": [step(1, 0, 0, 2)]}},
             "lanpo": {0: {"metrics": [step(1, 0, 0, 4), step(2, 4, 1, 3, 0.25)]},
                       1: {"metrics": [step(1, 4, 2, 1, float("nan")), step(2, 4, 0, 1, 1.0)]}}}
    assert learning.channel_verdicts(final["lanpo"][0]["metrics"], "abstract") == ([1.0, 0, 0, 0], [1.0, 1, 1, 0])
    lines = learning.channel_lines(["grpo", "lanpo"], ["--steps", "2"], [0, 1], final)
    rows = [line for line in lines if line.startswith("| lanpo")]
    assert not any(line.startswith("| grpo") for line in lines) and len(rows) == 2
    assert rows[0] == "| lanpo | reflect | 0 / 0: never fired | | | |  |"  # no judge for reflection
    assert rows[1].startswith("| lanpo | abstract | 3 / 12 (0.250) | 5 / 12 (0.417) | -0.167 [")
    assert rows[1].endswith("| -0.500, +0.000 | 0.25-1.00 |")
    assert learning.channel_lines(["grpo"], ["--steps", "2"], [0, 1], final) == []
