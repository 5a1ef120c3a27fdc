"""--reward module:function: the rewards of the functions below (defined in this file, as a user's would be in
theirs) reach training's advantages and pool and evaluation's records; failing, hanging and non-numeric calls
score 0, are counted and named, and a function that always fails stops the run."""

import json
import re
import sys
import time

import pytest
from conftest import ROOT
from test_train import documented_metric_keys

import config
import evaluate
import lanpo
import reward


def shaped(problem: dict, completion: str) -> float:
    """Depends on both arguments, so a wrong problem or text shows as a wrong number."""
    return len(completion) % 5 + len(problem["problem"]) % 3 / 10


def picky(problem: dict, completion: str) -> float:
    if problem["id"] == "raises":
        raise ValueError("no answer line")
    if problem["id"] == "hangs":
        time.sleep(60)
    if problem["id"] == "text":
        return "0.5"
    if problem["id"] == "nan":
        return float("nan")
    print("printed by the reward")  # must not be taken for the reply
    return 1.5


def always_fails(problem: dict, completion: str) -> float:
    raise RuntimeError("broken")


ROWS = [{"id": name, "problem": "p", "answer": "1"} for name in ("fine", "raises", "hangs", "text", "nan", "fine2")]


def test_a_reward_function_is_scored_and_its_failures_bounded_counted_and_named(capsys):
    rewarder = reward.Rewarder("test_reward:picky", timeout=1.0, workers=2)
    try:
        t0 = time.perf_counter()
        assert rewarder.scores(ROWS, ["x"] * len(ROWS)) == [1.5, 0.0, 0.0, 0.0, 0.0, 1.5]
        assert time.perf_counter() - t0 < 20  # the hanging call was cut at its 1 s bound, not waited for
        assert rewarder.failures == 4
        assert rewarder.scores(ROWS[:1], ["x"]) == [1.5]  # the killed worker was replaced
    finally:
        rewarder.close()
    first = capsys.readouterr().err.strip().splitlines()
    assert first == [rewarder.first_failure]  # printed once, whatever fails later
    assert first[0] == "--reward test_reward:picky failed on problem 'raises': ValueError: no answer line (scored 0)"


def test_each_kind_of_failure_is_described():
    rewarder = reward.Rewarder("test_reward:picky", timeout=1.0, workers=1)
    try:
        for row, says in [("raises", "ValueError: no answer line"), ("hangs", "no reward within --reward-timeout 1.0s"),
                          ("text", "returned '0.5', not a finite number"), ("nan", "returned nan, not a finite")]:
            rewarder.first_failure = ""
            rewarder.scores([{"id": row, "problem": "p", "answer": "1"}, ROWS[0]], ["x", "x"])
            assert f"failed on problem {row!r}: " in rewarder.first_failure and says in rewarder.first_failure
    finally:
        rewarder.close()


def test_a_function_that_always_fails_stops_the_run_naming_it():
    rewarder = reward.Rewarder("test_reward:always_fails", workers=1)
    try:
        with pytest.raises(SystemExit, match="test_reward:always_fails failed on all 2 completions .*"
                                             "RuntimeError: broken"):
            rewarder.scores(ROWS[:2], ["a", "b"])
    finally:
        rewarder.close()


@pytest.mark.parametrize("spec, says", [("nosuchmodule:f", "cannot import nosuchmodule: ModuleNotFoundError"),
                                        ("test_reward:missing", "test_reward has no function missing"),
                                        ("test_reward", "expected 'math' or module:function")])
def test_a_reward_that_does_not_resolve_is_one_line(spec, says):
    with pytest.raises(SystemExit, match=says) as stop:
        reward.Rewarder(spec)
    assert "\n" not in str(stop.value.code)


def test_training_and_evaluation_use_the_reward_function(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    pool = lanpo.main(config.parse_config([
        "--model", str(tiny_model_dir), "--out-dir", str(out), "--steps", "2", "--batch-problems", "2",
        "--group-size", "4", "--micro-batch", "4", "--max-new-tokens", "8", "--synthetic-size", "2",
        "--eval-every", "0", "--report-to", "none", "--feedback", "reflect", "--reward", "test_reward:shaped"]))
    trials = [t for ts in pool.trials.values() for t in ts]
    assert len(trials) == 16 and len({t.reward for t in trials}) > 1
    assert [t.reward for t in trials] == pytest.approx([shaped({"problem": t.problem}, t.response) for t in trials])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_step = [[t.reward for t in trials if t.step == s] for s in (1, 2)]
    assert [r["reward_mean"] for r in records] == pytest.approx([sum(r) / len(r) for r in by_step])
    assert [r["reward_failures"] for r in records] == [0, 0]
    assert set(records[0]) - {"step"} <= documented_metric_keys()  # reward_failures is in docs/metrics.md

    summary = evaluate.main(["--model", str(out / "final"), "--benchmarks", "synthetic:arith", "--limit", "3",
                             "--max-new-tokens", "8", "--reward", "test_reward:shaped", "--mode", "zero-shot",
                             "reflect", "--out-dir", str(tmp_path / "eval")])
    rows = [json.loads(line) for line in (tmp_path / "eval" / "problems.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["rewards"] == [shaped(r, text) for text in r["responses"]]
        if r["mode"] == "reflect":
            assert r["turn2_rewards"] == [shaped(r, text) for text in r["turn2_responses"]]
    zero_shot = [r for r in rows if r["mode"] == "zero-shot"]
    assert summary["synthetic:arith"]["zero-shot"]["reward"] == pytest.approx(
        sum(r["rewards"][0] for r in zero_shot) / len(zero_shot))


def test_the_math_reward_reads_no_answer_from_a_cut_completion():
    rewarder = reward.Rewarder()
    rows = [{"id": "p", "problem": "What is 10 + 5?", "answer": "15"}] * 2
    assert rewarder.scores(rows, ["The answer is 15"] * 2, [True, False]) == [0.0, 1.0]
    assert rewarder.scores(rows, ["The answer is 15"] * 2) == [1.0, 1.0]  # no flags: nothing was cut


def test_accuracy_is_the_graders_verdict_whatever_the_reward():
    """Under --reward module:function the reward is the function's and the accuracy metrics still read the math
    grader's verdict (a reward of 1.0 is not "correct", and a right answer rewarded 0.5 is)."""
    from rollout import Completion
    rows = [{"id": "a", "problem": "What is 2 + 3?", "answer": "5"}] * 3
    texts = ["\\boxed{5}", "\\boxed{6}", "The answer is 5"]
    completions = [Completion([1], [2], cut, text) for text, cut in zip(texts, (False, False, True))]
    rewarder = reward.Rewarder("test_reward:shaped", workers=1)
    try:
        rewards, verdicts = lanpo.grade_all(rewarder, completions, rows)
    finally:
        rewarder.close()
    assert rewards.tolist() == pytest.approx([shaped(rows[0], t) for t in texts])
    assert verdicts.tolist() == [1.0, 0.0, 0.0]  # the third is cut at the limit: no answer
    math = reward.Rewarder()
    assert [v.tolist() for v in lanpo.grade_all(math, completions, rows)] == [[1.0, 0.0, 0.0]] * 2


def test_the_readmes_reward_recipe_runs_as_written(tmp_path, monkeypatch):
    """The README's my_reward.py, saved as it is in the directory a run starts from: `--reward
    my_reward:correct_and_short` imports it there and scores the grader's verdict less 0.001 a word."""
    section = (ROOT / "README.md").read_text().split("\n## Your own reward\n", 1)[1].split("\n## ", 1)[0]
    source = re.search(r"```python\n(# my_reward\.py.*?)```", section, flags=re.S).group(1)
    (tmp_path / "my_reward.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    rewarder = reward.Rewarder("my_reward:correct_and_short")
    try:
        got = rewarder.scores([{"id": "a", "problem": "What is 3 + 4?", "answer": "7"}] * 2,
                              ["so the answer is \\boxed{7}", "it is \\boxed{8}"])
    finally:
        rewarder.close()
        sys.modules.pop("my_reward", None)
    assert got == pytest.approx([1 - 0.001 * 5, -0.001 * 3])
