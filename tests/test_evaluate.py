"""evaluate.py, scoring.py, plot.py: metrics against hand-computed values, reflect turns, outputs, bad input."""

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
from conftest import fake_grade

import config
import evaluate
import lanpo
import math_grader
import plot
import scoring
from pool import ExperiencePool, Trial


def test_pass_at_k_closed_form():
    assert scoring.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert scoring.pass_at_k(4, 0, 3) == 0.0 and scoring.pass_at_k(4, 4, 1) == 1.0
    assert scoring.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 40)
        c, k = rng.randint(0, n), rng.randint(1, n)
        assert scoring.pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    with pytest.raises(ValueError, match=r"^pass@3 needs at least 3 samples, got 2$"):
        scoring.pass_at_k(2, 1, 3)


def test_majority_vote_with_ties():
    assert scoring.majority_correct(["2", "2", "3"], [1, 1, 0]) == 1.0
    assert scoring.majority_correct(["3", "3", "2"], [0, 0, 1]) == 0.0
    assert scoring.majority_correct(["2", "3"], [1, 0]) == 0.5                     # 1-1 tie
    assert scoring.majority_correct(["2", "3", "3", "2", None, None], [1, 0, 0, 1, 0, 0]) == 0.5  # None never votes
    assert scoring.majority_correct(["\\frac{1}{2}", "\\dfrac{1}{2}", "3"], [1, 1, 0]) == 1.0  # same after normalising
    assert scoring.majority_correct(["4", "5", "6"], [0, 1, 1]) == pytest.approx(2 / 3)   # three-way tie
    assert scoring.majority_correct([None, "5", None, "5", "6"], [0, 1, 0, 1, 0]) == 1.0  # a None first too
    assert scoring.majority_correct([None, None], [0, 0]) == 0.0


def test_summarize_by_hand():
    records = [
        {"verdicts": [1.0, 0.0], "answers": ["1", "2"], "lengths": [10, 20], "truncated": [False, True]},
        {"verdicts": [0.0, 0.0], "answers": ["7", "7"], "lengths": [30, 30], "truncated": [False, False]},
    ]
    s = scoring.summarize(records, 2)
    assert scoring.summarize([dict(records[0], rewards=[0.5, 1.5])], 2)["reward"] == 1.0  # one problem, a --reward
    assert s["avg@2"] == 0.25 and s["pass@1"] == 0.25 and s["pass@2"] == 0.5
    assert s["maj@2"] == 0.25  # problem 1: tie 1-1 -> 0.5; problem 2: 0
    assert s["response_len"] == 22.5 and s["truncated"] == 0.25 and s["problems"] == 2


def _bench(tmp_path, n=6, name="bench.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"id": f"b{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(n)))
    return path


def test_reflect_mode_runs_two_turns_and_counts_flips(tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(math_grader, "grade", fake_grade)
    model, tokenizer = tiny
    rows = evaluate.load_benchmark(str(_bench(tmp_path)), 0, 0, "test", [1, 2, 3], 48)
    cfg = config.Config(max_new_tokens=6, attempt_tokens=32)
    records, summary = scoring.evaluate_rows(model, tokenizer, rows, "reflect", cfg, [2], samples=3, temperature=1.0)
    pairs = [(b, a) for r in records for b, a in zip(r["verdicts"], r["turn2_verdicts"])]
    assert len(pairs) == 18 and all(len(r["turn2_responses"]) == 3 for r in records)
    assert summary["flip_wrong_to_right"] == sum(a and not b for b, a in pairs) / 18
    assert summary["flip_right_to_wrong"] == sum(b and not a for b, a in pairs) / 18
    assert summary["turn2_avg@3"] == pytest.approx(sum(a for _, a in pairs) / 18)
    assert summary["avg@3"] == pytest.approx(sum(b for b, _ in pairs) / 18)
    assert {"pass@1", "pass@2", "maj@3", "turn2_pass@2", "turn2_maj@3"} <= set(summary)


def test_cli_writes_summary_table_and_per_problem_file(tiny_model_dir, tmp_path, capsys):
    a, b = _bench(tmp_path, 8, "a.jsonl"), _bench(tmp_path, 5, "b.jsonl")
    out = tmp_path / "eval"
    results = evaluate.main(["--model", str(tiny_model_dir), "--benchmarks", str(a), str(b), "--limit", "4",
                             "--mode", "zero-shot", "reflect", "--max-new-tokens", "6", "--out-dir", str(out)])
    assert set(results) == {"a.jsonl", "b.jsonl", "overall"}
    assert results["overall"]["zero-shot"]["problems"] == 8 and "flip_wrong_to_right" in results["overall"]["reflect"]
    lines = [json.loads(x) for x in (out / "problems.jsonl").read_text().splitlines()]
    assert len(lines) == 16 and {"prompt", "responses", "answers", "verdicts", "gold"} <= set(lines[0])
    assert "| a.jsonl | reflect |" in (out / "summary.md").read_text()
    # the random model runs to the 6-token limit: each summary says its accuracies are a floor, once
    said = [line for line in capsys.readouterr().out.splitlines() if "hit --max-new-tokens 6 unfinished" in line]
    assert len(said) == 4 and said[0].startswith("a.jsonl [zero-shot]: 100% of the responses")
    again = evaluate.main(["--model", str(tiny_model_dir), "--benchmarks", str(a), "--limit", "4",
                           "--max-new-tokens", "6", "--out-dir", str(tmp_path / "eval2")])
    ids = lambda p: [json.loads(x)["id"] for x in (p / "problems.jsonl").read_text().splitlines()]  # noqa: E731
    assert ids(out)[:4] == ids(tmp_path / "eval2") and again["a.jsonl"]["zero-shot"] == pytest.approx(
        results["a.jsonl"]["zero-shot"] | {"seconds": again["a.jsonl"]["zero-shot"]["seconds"]})


def test_abstract_mode_uses_a_training_pool(tiny_model_dir, tmp_path):
    pool = ExperiencePool()  # no pool problem is a benchmark one ("What is i + 1?") in any order
    pool.add([Trial(f"t{i}", f"What is {i} + 20?", "scratch", "", f"{i} + 20 = {i + 20}", 1.0, 1) for i in range(5)])
    pool.save(tmp_path / "pool.jsonl")
    results = evaluate.main(["--model", str(tiny_model_dir), "--benchmarks", str(_bench(tmp_path)), "--mode",
                             "abstract", "--pool", str(tmp_path / "pool.jsonl"), "--relevance-threshold", "0",
                             "--max-new-tokens", "4", "--out-dir", str(tmp_path / "eval")])
    assert results["bench.jsonl"]["abstract"]["with_lessons"] == 1.0
    first = json.loads((tmp_path / "eval" / "problems.jsonl").read_text().splitlines()[0])
    assert "general principles" in first["prompt"]


def test_bad_input_fails_before_generation(tmp_path):
    with pytest.raises(SystemExit, match="mathh500: no such benchmark; did you mean math500?"):
        evaluate.main(["--model", "no/such-model", "--benchmarks", "mathh500"])
    no_answer = tmp_path / "x.jsonl"
    no_answer.write_text(json.dumps({"problem": "1+1"}) + "\n")
    with pytest.raises(SystemExit, match="no column 'answer'"):
        evaluate.main(["--model", "no/such-model", "--benchmarks", str(no_answer)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit):
        evaluate.main(["--model", "no/such-model", "--benchmarks", str(empty)])
    with pytest.raises(SystemExit, match="needs --pool"):
        evaluate.main(["--model", "no/such-model", "--benchmarks", str(no_answer), "--mode", "abstract"])
    with pytest.raises(SystemExit, match="--samples 1"):
        evaluate.main(["--model", "no/such-model", "--benchmarks", str(no_answer), "--samples", "4"])


def test_plot_overlays_runs(tmp_path, monkeypatch):
    for name, shift in (("grpo", 0.0), ("lanpo", 0.1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "reward_mean": 0.2 + shift + s / 100, "accuracy": 0.2, "response_len_mean": 30,
                        "scratch/reward": 0.2, "reflect/reward": 0.3,
                        **({"eval_accuracy": 0.4} if s % 2 else {})}) + "\n"
            for s in range(1, 6)))
    out = plot.main([str(tmp_path / "grpo"), str(tmp_path / "lanpo"), "-o", str(tmp_path / "c.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(SystemExit, match="two runs are named 'grpo'"):
        plot.main([str(tmp_path / "grpo"), str(tmp_path / "grpo" / "metrics.jsonl")])
    seen = {}
    monkeypatch.setattr(plot, "plot", lambda runs, out: seen.update(runs) or Path(out))
    plot.main([str(tmp_path / "grpo"), f"grpo-2={tmp_path / 'lanpo'}", "-o", str(tmp_path / "d.png")])
    assert list(seen) == ["grpo", "grpo-2"] and seen["grpo-2"][0][0]["reward_mean"] == pytest.approx(0.31)
    seen.clear()  # the same NAME= twice: two seeds of one arm
    plot.main([f"arm={tmp_path / 'grpo'}", f"arm={tmp_path / 'lanpo'}", "-o", str(tmp_path / "e.png")])
    assert list(seen) == ["arm"] and [r[0]["reward_mean"] for r in seen["arm"]] == pytest.approx([0.21, 0.31])
    with pytest.raises(SystemExit, match="'grpo' already names an unlabelled run"):
        plot.main([str(tmp_path / "grpo"), f"grpo={tmp_path / 'lanpo'}"])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit, match="line 1 is not JSON"):
        plot.main([str(tmp_path / "bad")])


def test_every_accuracy_carries_its_interval():
    rec = lambda v: {"verdicts": v, "answers": ["1"] * len(v), "lengths": [3] * len(v),  # noqa: E731
                     "truncated": [False] * len(v)}
    summary = scoring.summarize([rec([1.0, 0.0])] * 20 + [rec([1.0, 1.0])] * 20, 2)
    for key in ("avg@2", "pass@1", "pass@2", "maj@2"):
        assert summary[f"{key}_low"] <= summary[key] <= summary[f"{key}_high"]
    assert summary["pass@2"] == summary["pass@2_low"] == summary["pass@2_high"] == 1.0  # every problem solved
    assert 0.65 < summary["avg@2_low"] < 0.75 < summary["avg@2_high"] < 0.85  # 0.75 +- 1.96 * 0.25 / sqrt(40)
    table = evaluate.markdown_table({"b": {"zero-shot": summary}})
    assert "0.750 [" in table and "avg@2_low" not in table


def _problems_file(path, verdicts, benchmark="x"):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "problems.jsonl", "w") as f:
        for i, v in enumerate(verdicts):
            f.write(json.dumps({"benchmark": benchmark, "mode": "zero-shot", "id": f"p{i}", "verdicts": [v],
                                "answers": ["1"]}) + "\n")


def test_compare_is_a_paired_bootstrap_on_the_same_problems(tmp_path):
    _problems_file(tmp_path / "a", [1.0] * 40)
    _problems_file(tmp_path / "b", [1.0] * 20 + [0.0] * 20)
    table = evaluate.main(["--compare", str(tmp_path / "a"), str(tmp_path / "b")])["compare"]
    row = next(line for line in table.splitlines() if line.startswith("| x |"))
    assert "| 40 | +0.500 [+0.350, +0.650] (p 0.000)" in row  # 0.5 +- 1.96 * 0.5 / sqrt(40), clipped to the grid
    _problems_file(tmp_path / "c", [1.0] * 39)
    with pytest.raises(SystemExit, match="evaluated different problems"):
        evaluate.main(["--compare", str(tmp_path / "a"), str(tmp_path / "c")])
    with pytest.raises(SystemExit, match="no problems.jsonl"):
        evaluate.main(["--compare", str(tmp_path / "a"), str(tmp_path / "nothing")])


ATTEMPT = "2 + 5 = 8, and 8 is odd. Checking once more with care: the answer is \\boxed{8}."


def _eval_prompts(tiny_model_dir, tmp_path, mode, flags, monkeypatch, pool=None):
    """evaluate.py's prompts for one problem under these flags, each turn as recorded in problems.jsonl; turn 1's
    response is ATTEMPT (sampling replaced), so that turn 2 shows what a training pool trial would."""
    import torch

    from rollout import Completion

    def first_turn_is_attempt(model, tokenizer, texts, cfg, temperature, eos_ids, progress=""):
        return [Completion(torch.tensor([1]), torch.tensor([2]), False, ATTEMPT) for _ in texts]

    if mode == "reflect":
        monkeypatch.setattr(scoring, "_sample", first_turn_is_attempt)
    bench = tmp_path / "one.jsonl"
    bench.write_text(json.dumps({"id": "p", "problem": "What is 2 + 5?", "answer": "7"}) + "\n")
    out = tmp_path / f"eval-{mode}"
    evaluate.main(["--model", str(tiny_model_dir), "--benchmarks", str(bench), "--mode", mode, "--max-new-tokens", "4",
                   "--abstract-max-tokens", "6", "--no-cpu-rows-first-matmul", "--out-dir", str(out), *flags,
                   *(["--pool", str(pool)] if pool else [])])
    return json.loads((out / "problems.jsonl").read_text().splitlines()[0])


REFLECTION_FLAGS = [[], ["--reflect-mode", "with-reward"], ["--reflect-mode", "with-gold"], ["--attempt-tokens", "6"],
                    ["--no-one-shot"], ["--reflect-source", "any"]]


@pytest.mark.parametrize("flags", REFLECTION_FLAGS, ids=lambda f: " ".join(f) or "default")
def test_evaluation_reflects_with_the_prompt_training_builds(tiny, tiny_model_dir, tmp_path, monkeypatch, flags):
    """Every flag that shapes a reflection prompt: evaluate.py's turn-2 prompt (recorded) is the one training
    builds from a pool holding the same attempt with the same verdict, and the flag changes it as it changes
    training's (or, --reflect-source, changes neither: turn 1 is from scratch)."""
    _, tokenizer = tiny
    row = {"id": "p", "problem": "What is 2 + 5?", "answer": "7"}
    pool = ExperiencePool()
    pool.add([Trial("p", row["problem"], "scratch", "", ATTEMPT, 0.0, 1)])

    def training(*f):
        cfg = config.parse_config(["--feedback", "reflect", "--feedback-ratio", "1", *f])
        return lanpo.build_prompts(tokenizer, [row], pool, {}, cfg)[0]

    assert training(*flags).kind == "reflect"
    record = _eval_prompts(tiny_model_dir, tmp_path, "reflect", flags, monkeypatch)
    assert record["turn2_prompts"] == [training(*flags).text]
    assert (training(*flags).text != training().text) == (flags not in ([], ["--reflect-source", "any"]))


@pytest.mark.parametrize("mode", ["agnostic", "with-reward", "with-gold"])
def test_evaluation_shows_as_many_attempts_as_training(tiny, monkeypatch, mode):
    """--reflect-attempts 2 with 3 samples: each sample's turn-2 prompt shows its own first attempt, then
    the problem's next one, exactly as training shows a pool holding those two trials (newest first) under
    every --reflect-mode; with --reflect-attempts 1 (the default) it shows its own attempt alone."""
    import torch

    from rollout import Completion

    model, tokenizer = tiny
    row = {"id": "p", "problem": "What is 2 + 5?", "answer": "7"}
    attempts = ["2 + 5 = 7, so \\boxed{7}.", "2 + 5 = 8: \\boxed{8}.", "It is \\boxed{9}."]
    turns = iter([[Completion(torch.tensor([1]), torch.tensor([2]), False, a) for a in attempts], None])

    def sampled(model, tokenizer, texts, cfg, temperature, eos_ids, progress=""):
        first = next(turns)
        return first or [Completion(torch.tensor([1]), torch.tensor([2]), False, "x") for _ in texts]

    monkeypatch.setattr(scoring, "_sample", sampled)
    monkeypatch.setattr(math_grader, "grade", lambda text, gold, **kw: float(f"{{{gold}}}" in text))
    flags = ["--feedback", "reflect", "--feedback-ratio", "1", "--reflect-attempts", "2", "--reflect-mode", mode]
    cfg = config.parse_config(flags)
    records, _ = scoring.evaluate_rows(model, tokenizer, [row], "reflect", cfg, [2], samples=3, temperature=1.0)
    for j, following in ((0, 1), (1, 0), (2, 0)):
        pool = ExperiencePool()
        pool.add([Trial("p", row["problem"], "scratch", "", attempts[following], float(following == 0), 1),
                  Trial("p", row["problem"], "scratch", "", attempts[j], float(j == 0), 2)])
        assert records[0]["turn2_prompts"][j] == lanpo.build_prompts(tokenizer, [row], pool, {}, cfg)[0].text
        assert attempts[j][:10] in records[0]["turn2_prompts"][j]
        assert attempts[following][:10] in records[0]["turn2_prompts"][j]
    turns = iter([[Completion(torch.tensor([1]), torch.tensor([2]), False, a) for a in attempts], None])
    default = config.parse_config(flags[:4] + flags[6:])  # --reflect-attempts 1
    one = scoring.evaluate_rows(model, tokenizer, [row], "reflect", default, [2], samples=3,
                                temperature=1.0)[0][0]["turn2_prompts"]
    assert [sum(a[:10] in prompt for a in attempts) for prompt in one] == [1, 1, 1]


def test_a_reflection_mode_added_as_the_readme_says(tiny, tmp_path, monkeypatch):
    """The README's recipe: one entry in reflect.MODES (a request that needs two attempts) is a --reflect-mode
    choice, reaches training's prompts once a problem has two earlier attempts (scratch before), reaches
    evaluate.py's turn 2 as training builds it, and evaluate.py refuses fewer samples than it needs."""
    import torch

    import prompts
    import reflect
    from rollout import Completion

    line = "\nSay where the attempts differ before you solve it."
    monkeypatch.setitem(reflect.MODES, "compare", reflect.Mode(
        lambda problem, shown, rewards, gold: prompts.reflection_request(problem, shown) + line, reads_labels=False,
        least_attempts=2))
    model, tokenizer = tiny
    cfg = config.parse_config(["--feedback", "reflect", "--feedback-ratio", "1", "--reflect-mode", "compare",
                               "--reflect-attempts", "2"])
    row = {"id": "p", "problem": "What is 2 + 5?", "answer": "7"}
    attempts = ["2 + 5 = 7, so \\boxed{7}.", "2 + 5 = 8: \\boxed{8}."]
    pool = ExperiencePool()
    pool.add([Trial("p", row["problem"], "scratch", "", attempts[1], 0.0, 1)])
    assert {p.kind for p in lanpo.build_prompts(tokenizer, [row], pool, {}, cfg)} == {"scratch"}  # one attempt
    pool.add([Trial("p", row["problem"], "scratch", "", attempts[0], 1.0, 2)])
    built = lanpo.build_prompts(tokenizer, [row], pool, {}, cfg)
    assert {p.kind for p in built} == {"reflect"} and line.strip() in built[0].text
    turns = iter([[Completion(torch.tensor([1]), torch.tensor([2]), False, a) for a in attempts], None])
    monkeypatch.setattr(scoring, "_sample", lambda model, tokenizer, texts, *a, **k: next(turns) or [
        Completion(torch.tensor([1]), torch.tensor([2]), False, "x") for _ in texts])
    records, _ = scoring.evaluate_rows(model, tokenizer, [row], "reflect", cfg, [2], samples=2, temperature=1.0)
    assert records[0]["turn2_prompts"][0] == built[0].text
    with pytest.raises(SystemExit, match="--reflect-mode compare shows at least 2 first attempts"):
        evaluate.main(["--model", "no/such-model", "--benchmarks", str(_bench(tmp_path)), "--mode", "reflect",
                       "--reflect-mode", "compare", "--temperature", "1"])


# on top of raw trajectories at gamma 0 (the lessons are then text the flags shape, not a tiny model's output)
ABSTRACTION_FLAGS = [[], ["--abstract-mode", "principles"], ["--abstract-candidates", "1"], ["--attempt-tokens", "6"],
                     ["--no-one-shot"], ["--relevance-threshold", "0.5308"],
                     ["--relevance-threshold", "0.5308", "--relevance-text", "problem"],
                     ["--retriever", "policy", "--abstract-candidates", "1"], ["--pool-per-problem", "1"]]


@pytest.mark.parametrize("flags", ABSTRACTION_FLAGS, ids=lambda f: " ".join(f) or "default")
def test_evaluation_abstracts_with_the_prompt_training_builds(tiny, tiny_model_dir, tmp_path, monkeypatch, flags):
    """Every flag that shapes an abstraction prompt: evaluate.py --mode abstract's prompt (recorded) is the one
    training builds from the same pool, and the flag changes it as it changes training's."""
    import abstract
    from pool import EmbeddingIndex

    model, tokenizer = tiny
    row = {"id": "p", "problem": "What is 2 + 5?", "answer": "7"}
    saved = ExperiencePool()  # two trials of each problem: the newer one wrong, so best_trial picks the older
    for step, reward, answer in ((1, 1.0, "{i} + 2 = {r}. " * 4), (2, 0.0, "{i} + 2 = {w}?")):
        saved.add([Trial(f"t{i}", f"What is {i} + 2?", "scratch", "", answer.format(i=i, r=i + 2, w=i + 3), reward,
                         step) for i in range(3)])
    saved.save(tmp_path / "pool.jsonl")
    base = ["--relevance-threshold", "0", "--abstract-mode", "raw"]

    def training(*f):
        cfg = config.parse_config(["--feedback", "abstract", "--feedback-ratio", "1", "--abstract-max-tokens", "6", *f])
        index = EmbeddingIndex(abstract.hidden_state_embedder(model, tokenizer)) if cfg.retriever == "policy" else None
        pool = ExperiencePool(cfg.pool_per_problem, cfg.pool_max_problems, index)  # as lanpo.setup builds it
        pool.load(tmp_path / "pool.jsonl")
        lessons, _ = abstract.lessons_for(model, tokenizer, pool, [row], {}, 1, cfg, [tokenizer.eos_token_id])
        return lanpo.build_prompts(tokenizer, [row], pool, lessons, cfg)[0]

    flags = base + flags
    assert _eval_prompts(tiny_model_dir, tmp_path, "abstract", flags, monkeypatch, tmp_path / "pool.jsonl")[
        "prompt"] == training(*flags).text
    # the tiny model's relevance scores: 0.5292-0.5295 reading the solutions (none kept at 0.5308: a plain
    # prompt), 0.5307-0.5309 reading the problems only (two of three kept); one trial a problem: the wrong one
    assert (training(*flags).text != training(*base).text) == (len(flags) > len(base))
    if "--relevance-text" in flags:
        assert training(*flags).text.count("Related problem") == 2
        assert training(*flags[:-2]).kind == "scratch"


def test_evaluation_reads_data_with_training_flags(tmp_path, monkeypatch):
    """The same data syntax and field flags as lanpo.py (one definition, data.load_problems): custom columns,
    bad rows skipped, a byte-order mark, hub:<id>."""
    path = tmp_path / "own.csv"
    path.write_text("\ufeffqid,question,gold\nq1,What is 1 + 1?,2\nq2,,3\nq3,What is 2 + 2?,4\n", encoding="utf-8")
    fields = dict(id_field="qid", problem_field="question", answer_field="gold", skip_bad=True)
    rows = evaluate.load_benchmark(str(path), 0, 0, "test", [1], 48, **fields)
    assert rows == [{"id": "q1", "problem": "What is 1 + 1?", "answer": "2"},
                    {"id": "q3", "problem": "What is 2 + 2?", "answer": "4"}]
    import data

    asked = []
    monkeypatch.setattr(data, "read_hub", lambda dataset_id, split: asked.append((dataset_id, split)) or [
        ("row 0", {"id": "h", "problem": "P?", "answer": "1"})])
    assert evaluate.load_benchmark("hub:math500", 0, 0, "test", [1], 48)[0]["id"] == "h"  # hub even for a name
    assert asked == [("math500", "test")]
    args = ["--model", "no/such-model", "--benchmarks", str(path), "--problem-field", "question"]
    with pytest.raises(SystemExit, match="no column 'answer'"):  # the flags reach the loader
        evaluate.main(args)


def test_evaluation_refuses_what_it_cannot_honour(tmp_path):
    bench = _bench(tmp_path)
    with pytest.raises(SystemExit, match="--pool missing.jsonl: file not found"):
        evaluate.main(["--model", "no/such-model", "--benchmarks", str(bench), "--mode", "abstract",
                       "--pool", "missing.jsonl"])


def test_a_cut_response_is_graded_as_cut_in_evaluation():
    from rollout import Completion
    cut = Completion(text="The answer is 15", prompt_ids=[1], completion_ids=[2, 3], truncated=True)
    whole = Completion(text="The answer is 15", prompt_ids=[1], completion_ids=[2, 3], truncated=False)
    record = scoring._record({"id": "p", "problem": "What is 10 + 5?", "answer": "15"}, "prompt", [cut, whole])
    assert record["verdicts"] == [0.0, 1.0] and record["answers"] == [None, "15"]


def test_pool_problems_that_are_evaluated_ones_are_reported_and_dropped(tmp_path, capsys):
    """A pool of seed 0's training problems, evaluated on seed 1's held-out problems: the seeds' splits are
    not disjoint, so some pool problems are evaluated ones in other words (operands and answer), and a file
    pool can hold an evaluated problem's text. Each is dropped and named before any model loads."""
    import data
    rows = data.synthetic_arith("test", 256, seed=1, levels=[1, 2, 3], train_size=48)
    train = data.synthetic_arith("train", 400, seed=0, levels=[1, 2, 3])
    pool = ExperiencePool(max_problems=1000)
    pool.add([Trial(r["id"], r["problem"], "scratch", "", r["answer"], 1.0, 1, data.content_key(r)) for r in train])
    pool.add([Trial("file-1", rows[0]["problem"].replace(" ", "  "), "scratch", "", "x", 0.0, 1)])
    keys = {data.content_key(r) for r in rows}
    expected = {r["id"] for r in train if data.content_key(r) in keys} | {"file-1"}
    assert len(expected) > 5
    twins = evaluate.drop_pool_twins(pool, {"synthetic:arith": rows})
    assert {p for p, _ in twins} == expected and not expected & set(pool.trials)
    assert f"dropped {len(expected)} pool problems" in capsys.readouterr().out


def test_a_run_is_not_evaluated_on_problems_it_trained_on(tmp_path, capsys):
    """A run trained on a file is evaluated on a benchmark holding two of its training problems in other words
    (layout; reworded): both are left out and named, or with --eval-overlap refuse the evaluation stops. The
    run's training problems come from its config.json (a run directory, its final/, or a checkpoint)."""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "t1", "problem": "Find $x$ if $2x = 10$.", "answer": "5"},
        {"id": "t2", "problem": "If $x$, $y$, and $z$ are positive with $xy=24$, $xz = 48$, and $yz=72$, what is "
                                "the value of $x+y+z$?", "answer": "22"},
        {"id": "t3", "problem": "What is 3 + 4?", "answer": "7"}]))
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"dataset": str(train), "eval_every": 0}))
    (run / "metrics.jsonl").write_text("")
    bench = [{"id": "b1", "problem": "find x if 2x = 10", "answer": "5"},
             {"id": "b2", "problem": "If $x$, $y$, and $z$ are positive with $xy = 24$, $xz = 48$, and $yz = 72$, "
                                    "then find $x + y + z.$", "answer": "22"},
             {"id": "b3", "problem": "What is 4 + 4?", "answer": "8"}]
    for model in (run, run / "final", run / "checkpoints" / "step-000002"):
        found, rows = evaluate.training_rows_of(str(model))
        assert found == run and [r["id"] for r in rows] == ["t1", "t2", "t3"]
    assert evaluate.training_rows_of(str(tmp_path)) is None
    benchmarks = {"bench": list(bench)}
    twins = evaluate.drop_training_twins(evaluate.training_rows_of(str(run)), benchmarks, refuse=False)
    assert twins == [("t1", "b1", "same text"), ("t2", "b2", "reworded")]
    assert [r["id"] for r in benchmarks["bench"]] == ["b3"] and "left out 2 problems" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="2 evaluated problems are training problems"):
        evaluate.drop_training_twins(evaluate.training_rows_of(str(run)), {"bench": list(bench)}, refuse=True)


def test_two_tiny_runs_compared_as_a_table_and_curves(tiny_model_dir, tmp_path, capsys):
    """A GRPO and a LANPO run of the tiny model on the same held-out problems: the table gives each one's
    steps, held-out accuracy from step 0 with the gain, rollouts per kind, relevance, time and disk, and the
    LANPO run paired against the GRPO one; the curves start at step 0 and draw only panels with data."""
    for name, feedback in (("grpo", "none"), ("lanpo", "both")):
        lanpo.main(config.parse_config([
            "--model", str(tiny_model_dir), "--out-dir", str(tmp_path / name), "--steps", "3", "--feedback", feedback,
            "--batch-problems", "2", "--group-size", "4", "--max-new-tokens", "4", "--synthetic-size", "2",
            "--eval-every", "3", "--eval-size", "5", "--relevance-threshold", "0", "--abstract-max-tokens", "4",
            "--report-to", "none", "--no-final-checkpoint"]))
    capsys.readouterr()
    # what the model wrote, readable without wandb: each evaluation's first rollout of each kind and held-out answers
    samples = (tmp_path / "lanpo" / "samples.md").read_text()
    assert samples.startswith("## step 0\n") and "\n## step 3\n" in samples
    step3 = samples.split("## step 3")[1]
    assert {"| train scratch |", "| train reflect |", "| train abstract |"} <= {
        line[:line.index(" |", 2) + 2] for line in step3.splitlines() if line.startswith("| train")}
    assert step3.count("| held-out |") == 4 and "## step 0" not in step3
    out = plot.main([str(tmp_path / "grpo"), str(tmp_path / "lanpo"), "-o", str(tmp_path / "c.png")])
    table = capsys.readouterr().out.split("\nwrote ")[0]
    assert (tmp_path / "c.md").read_text().strip() == table.strip() and out.read_bytes()[:4] == b"\x89PNG"
    grpo, lanpo_row = [line.split(" | ") for line in table.splitlines()[2:]]
    assert grpo[0] == "| grpo" and grpo[1] == "3" and "(step 0) ->" in grpo[3] and "(step 3)" in grpo[3]
    assert grpo[5] == "24 / 0 / 0" and grpo[6] == "-" and grpo[9] == "- |"
    scratch, reflect_n, abstract_n = map(int, lanpo_row[5].split(" / "))
    assert scratch + reflect_n + abstract_n == 24 and reflect_n > 0 and abstract_n > 0
    assert lanpo_row[6].endswith(f"of {lanpo_row[6].split(' of ')[1]}") and lanpo_row[9].startswith(("+", "-"))
    assert float(grpo[8].removesuffix(" MB")) > 0 and grpo[7].endswith(" min")
    grpo_only = {"grpo": [plot.read_metrics(tmp_path / "grpo")]}
    assert grpo_only["grpo"][0][0].keys() == {"step", "eval_accuracy"} and grpo_only["grpo"][0][0]["step"] == 0
    titles = [title for title, _ in plot.panels_with_data(grpo_only)]
    assert "feedback rollouts per step" not in titles and "feedback through the gradient" not in titles
    assert "feedback rollouts per step" in [t for t, _ in plot.panels_with_data(
        {"lanpo": [plot.read_metrics(tmp_path / "lanpo")]})]


def test_each_evaluation_logs_a_samples_table_to_wandb(tiny_model_dir, tmp_path, monkeypatch):
    """With wandb on, every evaluation logs a `samples` table (kind, problem, response, score) at its step."""
    import sys
    import types
    logged = []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    def init(**kwargs):
        return types.SimpleNamespace(log=lambda record, step: logged.append((step, record)), finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Table=Table))
    monkeypatch.setenv("WANDB_MODE", "offline")
    lanpo.main(config.parse_config([
        "--model", str(tiny_model_dir), "--out-dir", str(tmp_path / "run"), "--steps", "2", "--batch-problems", "2",
        "--group-size", "4", "--max-new-tokens", "4", "--synthetic-size", "2", "--eval-every", "2", "--eval-size",
        "3", "--report-to", "auto", "--no-final-checkpoint"]))
    tables = [(step, r["samples"]) for step, r in logged if "samples" in r]
    assert [step for step, _ in tables] == [0, 2]
    assert tables[1][1].columns == ["kind", "problem", "response", "score"]
    kinds = [row[0] for row in tables[1][1].data]
    assert "train scratch" in kinds and len(set(kinds)) == len(kinds) - 2 and kinds[-3:] == ["held-out"] * 3
    assert [row[0] for row in tables[0][1].data] == ["held-out"] * 3  # step 0: nothing trained yet


def test_report_to_tensorboard_logs_every_metric_and_the_samples(tiny_model_dir, tmp_path):
    """--report-to tensorboard writes <out-dir>/tensorboard: each metrics.jsonl number as a scalar at its step,
    and each evaluation's samples table as text; wandb stays off."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "run"
    lanpo.main(config.parse_config([
        "--model", str(tiny_model_dir), "--out-dir", str(out), "--steps", "2", "--batch-problems", "2",
        "--group-size", "4", "--max-new-tokens", "4", "--synthetic-size", "2", "--eval-every", "2", "--eval-size",
        "3", "--report-to", "tensorboard", "--no-final-checkpoint"]))
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [
        (r["step"], pytest.approx(r["reward_mean"])) for r in records]
    assert [e.step for e in events.Scalars("eval_accuracy")] == [2]
    assert [e.step for e in events.Tensors("samples/text_summary")] == [0, 2]
    assert not (out / "wandb").exists()


class FakeSampler:
    """scoring's sampler replaced: records each call's prompts and settings; turn 1 answers each problem's
    first sample right and the others wrong (each response names its problem and sample), turn 2 answers
    right."""

    def __init__(self, rows):
        self.rows, self.calls = rows, []

    def __call__(self, model, tokenizer, texts, **settings):
        from types import SimpleNamespace

        self.calls.append((texts, settings))
        turn = len(self.calls)
        per_problem = len(texts) // len(self.rows)
        outs = []
        for i, _ in enumerate(texts):
            row, j = self.rows[i // per_problem], i % per_problem
            answer = row["answer"] if (j == 0 or turn == 2) else "0"
            outs.append(SimpleNamespace(text=f"attempt {row['id']}-{j} of turn {turn}: \\boxed{{{answer}}}",
                                        truncated=j == 2, completion_ids=[5] * (4 + j)))
        return outs


ROWS = [{"id": "p0", "problem": "What is the blick of 3 and 4?", "answer": "31337"},
        {"id": "p1", "problem": "What is the zorp of 5 and 6?", "answer": "27182"}]


def test_evaluate_rows_samples_each_mode_with_its_prompts_labels_and_settings(tiny, monkeypatch):
    """Every mode through a recording sampler: what each turn is asked, with which settings, and what the
    records and summary keep (zero-shot greedy; reflect with each sample's own attempt and no label unless
    a leaky --reflect-mode asks; a given first turn reused, not resampled; abstract with the lessons of the
    problems that have them; a --reward function beside the grader in both turns)."""
    _, tokenizer = tiny
    cfg = config.Config(max_new_tokens=7, top_p=0.9, gen_batch=3, attempt_tokens=64)
    plain = [scoring.prompts.render_prompt(tokenizer, scoring.prompts.problem_request(r["problem"]), cfg.one_shot)
             for r in ROWS]
    sampler = FakeSampler(ROWS)
    monkeypatch.setattr(scoring, "generate_completions", sampler)
    records, summary = scoring.evaluate_rows(None, tokenizer, ROWS, "zero-shot", cfg, [2], progress="bench")
    assert sampler.calls == [(plain, {"eos_ids": [2], "max_new_tokens": 7, "temperature": 1.0, "top_p": 0.9,
                                      "greedy": True, "batch_size": 3, "share_prefill": cfg.share_prefill,
                                      "compiled": cfg.compile_decoding, "progress": "bench"})]
    assert [(r["id"], r["gold"], r["prompt"], r["verdicts"], r["lessons"]) for r in records] == [
        ("p0", "31337", plain[0], [1.0], ""), ("p1", "27182", plain[1], [1.0], "")]
    assert summary["avg@1"] == 1.0 and summary["problems"] == 2 and "with_lessons" not in summary
    with pytest.raises(SystemExit, match=r"^greedy decoding \(--temperature 0\) gives one distinct sample: use "
                                         r"--samples 1$"):
        scoring.evaluate_rows(None, tokenizer, ROWS, "zero-shot", cfg, [2], samples=2)

    class Lengths:  # a --reward function: the response's length
        def scores(self, problems, texts, cut):
            assert [p["id"] for p in problems] == ["p0"] * 3 + ["p1"] * 3 and cut == [False, False, True] * 2
            return [float(len(t)) for t in texts]

    for leak in ("agnostic", "with-gold", "with-reward"):
        sampler = FakeSampler(ROWS)
        monkeypatch.setattr(scoring, "generate_completions", sampler)
        cfg.reflect_mode = leak
        records, summary = scoring.evaluate_rows(None, tokenizer, ROWS, "reflect", cfg, [2], samples=3,
                                                 temperature=0.7, rewarder=Lengths())
        (first, one), (second, two) = sampler.calls
        assert first == [plain[0]] * 3 + [plain[1]] * 3 and one["temperature"] == 0.7 and not one["greedy"]
        assert two["progress"] == "" and two["temperature"] == 0.7
        assert second == [p for r in records for p in r["turn2_prompts"]]
        for r in records:
            assert r["verdicts"] == [1.0, 0.0, 0.0] and r["turn2_verdicts"] == [1.0, 1.0, 1.0]
            assert r["rewards"] == [float(len(t)) for t in r["responses"]]
            assert r["turn2_rewards"] == [float(len(t)) for t in r["turn2_responses"]]
            assert r["turn2_lengths"] == [4, 5, 6] and r["turn2_truncated"] == [False, False, True]
            for j, prompt in enumerate(r["turn2_prompts"]):  # each sample reviews its own attempt alone
                assert prompt == scoring.reflect.reflection_prompt(
                    tokenizer, r["problem"], [r["responses"][j]], attempt_tokens=64, one_shot=True, mode=leak,
                    labels=lambda: ([r["verdicts"][j]], r["gold"]))[0]
                assert [f"attempt {r['id']}-{n} of turn 1" in prompt for n in range(3)] == [n == j for n in range(3)]
                assert (f"The correct final answer is {r['gold']}." in prompt) == (leak == "with-gold")
                assert ("This attempt was" in prompt) == (leak == "with-reward")
                if leak == "with-reward":
                    assert f"This attempt was {'correct' if j == 0 else 'incorrect'}." in prompt
        assert summary["flip_wrong_to_right"] == pytest.approx(4 / 6) and summary["flip_right_to_wrong"] == 0.0
        assert summary["turn2_avg@3"] == 1.0 and "turn2_problems" not in summary
        for prefix in ("", "turn2_"):  # the --reward function's mean over problems, with its interval
            means = [sum(r[prefix + "rewards"]) / 3 for r in records]
            assert summary[prefix + "reward"] == pytest.approx(sum(means) / 2)
            assert summary[prefix + "reward_low"] == pytest.approx(min(means))
            assert summary[prefix + "reward_high"] == pytest.approx(max(means))
    cfg.reflect_mode = "agnostic"

    monkeypatch.setattr(scoring, "generate_completions", FakeSampler(ROWS))
    given, _ = scoring.evaluate_rows(None, tokenizer, ROWS, "zero-shot", cfg, [2], samples=3, temperature=0.7)
    sampler = FakeSampler(ROWS)
    monkeypatch.setattr(scoring, "generate_completions", sampler)
    again, _ = scoring.evaluate_rows(None, tokenizer, ROWS, "reflect", cfg, [2], first_turn=given, samples=3,
                                     temperature=0.7, progress="bench")
    assert len(sampler.calls) == 1 and sampler.calls[0][1]["progress"] == "bench, turn 2"  # turn 1 reused
    assert [r["responses"] for r in again] == [r["responses"] for r in given]
    assert "turn2_responses" not in given[0] and "turn2_rewards" not in again[0]  # copies; no rewarder now

    with pytest.raises(SystemExit, match=r"^--mode abstract needs --pool \(a pool.jsonl saved by a training run\)$"):
        scoring.evaluate_rows(None, tokenizer, ROWS, "abstract", cfg, [2])
    asked = []

    def lessons_for(*args):
        asked.append(args)
        return {"p1": "The zorp adds ten."}, None

    monkeypatch.setattr(scoring.abstract, "lessons_for", lessons_for)
    pool = ExperiencePool()
    for mode, raw in (("principles", False), ("raw", True)):
        sampler = FakeSampler(ROWS)
        monkeypatch.setattr(scoring, "generate_completions", sampler)
        cfg.abstract_mode = mode
        records, summary = scoring.evaluate_rows("model", tokenizer, ROWS, "abstract", cfg, [2], pool=pool)
        assert asked[-1] == ("model", tokenizer, pool, ROWS, {}, 0, cfg, [2])
        with_lessons = scoring.prompts.render_prompt(tokenizer, scoring.prompts.abstraction_request(
            ROWS[1]["problem"], "The zorp adds ten.", raw=raw), cfg.one_shot)
        assert sampler.calls[0][0] == [plain[0], with_lessons]
        assert [r["lessons"] for r in records] == ["", "The zorp adds ten."] and summary["with_lessons"] == 0.5


def test_trim_hands_memory_back_after_each_benchmark_and_mode(tiny_model_dir, tmp_path, monkeypatch):
    import cpu

    calls = []
    monkeypatch.setattr(cpu, "trim_freed_host_memory", lambda: calls.append(1) or True)
    a, b = _bench(tmp_path, 3, "a.jsonl"), _bench(tmp_path, 3, "b.jsonl")
    evaluate.main(["--model", str(tiny_model_dir), "--benchmarks", str(a), str(b), "--mode", "zero-shot", "reflect",
                   "--max-new-tokens", "4", "--out-dir", str(tmp_path / "keep")])
    assert calls == []
    evaluate.main(["--model", str(tiny_model_dir), "--benchmarks", str(a), str(b), "--mode", "zero-shot", "reflect",
                   "--max-new-tokens", "4", "--cpu-host-memory", "trim", "--out-dir", str(tmp_path / "trim")])
    assert len(calls) == 4


def test_eval_budgets_reads_every_budgets_cut_share_from_one_generation(tiny_model_dir, tmp_path):
    """bench/eval_budgets.py: a response is cut at a budget unless it ended by itself within it (by hand), the
    chosen budget is the smallest past which the largest would finish at most the allowed share more, and the
    bench runs end to end."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import eval_budgets

    lengths, ended = [3, 5, 8, 8], [True, True, True, False]  # the last hit the limit of 8
    assert [eval_budgets.cut_share(lengths, ended, b) for b in (2, 3, 5, 8)] == [1.0, 0.75, 0.5, 0.25]
    assert eval_budgets.smallest_budget({2: 1.0, 3: 0.75, 5: 0.5, 8: 0.25}, 0.25) == 5  # 0.5 - 0.25 <= 0.25
    assert eval_budgets.smallest_budget({2: 1.0, 3: 0.75, 5: 0.5, 8: 0.25}, 0.5) == 3
    assert eval_budgets.smallest_budget({2: 1.0, 4: 0.3, 8: 0.22}, 0.05) == 8
    assert eval_budgets.smallest_budget({2: 1.0, 4: 0.22, 8: 0.22}, 0.05) == 4  # the rest never end
    result = eval_budgets.main(["--model", str(tiny_model_dir), "--dtype", "fp32", "--benchmarks", "synthetic:arith",
                                "--limit", "3", "--budgets", "2", "4", "--out", str(tmp_path / "b.json")])
    shares = result["benchmarks"]["synthetic:arith"]["cut_share"]
    assert set(shares) == {2, 4} and shares[2] >= shares[4] and (tmp_path / "b.json").exists()


def test_each_benchmark_gets_its_token_budget_unless_one_is_given(tiny_model_dir, tmp_path, monkeypatch):
    """Without --max-new-tokens a benchmark named in evaluate.TOKEN_BUDGETS gets its budget and any other
    training's default (48); the budget is in the summary. With the flag, every benchmark gets it."""
    seen, real = [], scoring.evaluate_rows
    monkeypatch.setattr(scoring, "evaluate_rows", lambda model, tokenizer, rows, mode, cfg, *a, **k: seen.append(
        cfg.max_new_tokens) or real(model, tokenizer, rows, mode, dataclasses.replace(cfg, max_new_tokens=2), *a, **k))
    bench = _bench(tmp_path, 2)
    got = evaluate.main(["--model", str(tiny_model_dir), "--benchmarks", "synthetic:arith", str(bench), "--limit", "2",
                         "--out-dir", str(tmp_path / "default")])
    assert seen == [evaluate.TOKEN_BUDGETS["synthetic:arith"], 48]
    assert got["synthetic:arith"]["zero-shot"]["max_new_tokens"] == evaluate.TOKEN_BUDGETS["synthetic:arith"]
    evaluate.main(["--model", str(tiny_model_dir), "--benchmarks", "synthetic:arith", str(bench), "--limit", "2",
                   "--max-new-tokens", "5", "--out-dir", str(tmp_path / "given")])
    assert seen[2:] == [5, 5]
