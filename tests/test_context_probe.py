"""bench/context_probe.py on CPU with the tiny model: which trials each context shows (relevant ones of the
problem's family, length-matched unrelated ones), that no context but `gold` shows a held-out answer, and the
whole probe end to end (every context paired on the same problems, every verdict written)."""

import importlib.util
import json
import re

import pytest
from conftest import ROOT

import config
import data
from pool import ExperiencePool, Trial

spec = importlib.util.spec_from_file_location("context_probe", ROOT / "bench" / "context_probe.py")
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def test_families_of_the_built_in_data():
    rules = data.synthetic_rules("train", 8, 0, [1], 8)
    assert [probe.family_of(r) for r in rules] == [r["family"] for r in rules]
    arith = {"content": "* 3 4 + 5"}
    assert probe.family_of(arith) == "* +" and probe.family_of({"content": "+ 2 9"}) == "+"
    assert probe.family_of({"id": "x", "problem": "p", "answer": "1"}) is None


def test_relevant_trials_are_the_family_and_irrelevant_ones_match_their_length(tiny):
    _, tokenizer = tiny
    train = data.synthetic_rules("train", 48, 0, [1, 2], 48)
    held = data.synthetic_rules("test", 16, 0, [1, 2], 48)
    pool = ExperiencePool()
    pool.add([Trial(r["id"], r["problem"], "scratch", "", r["solution"] + " x" * (i % 7), 1.0, 1)
              for i, r in enumerate(train)])
    family = {r["id"]: r["family"] for r in train + held}
    shown = probe.shown_trials(pool, tokenizer, 160)
    assert shown[train[0]["id"]] == pool.trials[train[0]["id"]][0]  # short responses stay as they are
    for row in held:
        relevant, irrelevant = probe.pick_experiences(row, pool, shown, family, 3)
        assert len(relevant) == 3 == len(irrelevant)  # six of each family in 48: enough of both
        assert all(family[t.problem_id] == row["family"] for t in relevant)
        assert all(family[t.problem_id] != row["family"] for t in irrelevant)
        assert len({t.problem_id for t in irrelevant}) == 3
        # the most similar of the family first, as the retriever ranks them
        ranked = [ts[0].problem_id for _, ts in pool.similar(row["problem"], 48, exclude_id=row["id"])]
        mine = [pid for pid in ranked if family[pid] == row["family"]]
        assert [t.problem_id for t in relevant] == mine[:3]
        # each unrelated trial is the nearest in length among those not yet taken
        others = [pid for pid in ranked if family[pid] != row["family"]]
        size = {t.problem_id: len(t.problem) + len(t.response) for ts in pool.trials.values() for t in ts}
        for rel, irr in zip(relevant, irrelevant):
            best = min(abs(size[pid] - size[rel.problem_id]) for pid in others)
            assert abs(size[irr.problem_id] - size[rel.problem_id]) == best
            others.remove(irr.problem_id)


def test_under_abstract_from_solved_relevant_and_irrelevant_trials_come_from_solved_problems(tiny):
    """--abstract-from solved: as training retrieves then, only problems with a correct trial are shown, on
    both sides; here every third training problem is solved, so the family's relevant trials are its solved
    ones (2 of its 6), where without the flag its 3 nearest are shown, solved or not."""
    _, tokenizer = tiny
    train = data.synthetic_rules("train", 48, 0, [1, 2], 48)
    held = data.synthetic_rules("test", 8, 0, [1, 2], 48)
    pool = ExperiencePool()
    pool.add([Trial(r["id"], r["problem"], "scratch", "", r["solution"], float(i % 3 == 0), 1)
              for i, r in enumerate(train)])
    solved = {r["id"] for i, r in enumerate(train) if i % 3 == 0}
    family = {r["id"]: r["family"] for r in train + held}
    shown = probe.shown_trials(pool, tokenizer, 160)
    for row in held:
        relevant, irrelevant = probe.pick_experiences(row, pool, shown, family, 3, solved=True)
        mine = [r["id"] for r in train if r["family"] == row["family"] and r["id"] in solved]
        assert sorted(t.problem_id for t in relevant) == sorted(mine[:3]) and len(irrelevant) == len(relevant)
        assert {t.problem_id for t in relevant + irrelevant} <= solved
        anyhow, _ = probe.pick_experiences(row, pool, shown, family, 3)
        assert len(anyhow) == 3 and not {t.problem_id for t in anyhow} <= solved


def test_the_probe_end_to_end_and_no_context_but_gold_shows_a_held_out_answer(tiny_model_dir, tmp_path, monkeypatch):
    seen = []
    real = probe.generate_completions

    def recording(model, tokenizer, texts, **kw):
        seen.append(list(texts))
        return real(model, tokenizer, texts, **kw)

    monkeypatch.setattr(probe, "generate_completions", recording)
    out = tmp_path / "probe.json"
    summary = probe.main(["--model", str(tiny_model_dir), "--dataset", "synthetic:rules", "--levels", "1-2",
                          "--synthetic-size", "16", "--eval-size", "8", "--max-new-tokens", "6",
                          "--abstract-max-tokens", "6", "--pool", "gold", "--out", str(out)])
    assert list(summary["contexts"]) == list(probe.CONTEXTS)
    assert all(c["with_context"] == 8 for c in summary["contexts"].values())  # two per family in 16: all have some
    saved = json.loads(out.read_text())
    held = data.load_rows(config.Config(dataset="synthetic:rules", levels="1-2", synthetic_size=16, eval_size=8))[1]
    assert saved["ids"] == [r["id"] for r in held]
    assert all(len(v) == 8 for v in (*saved["verdicts"].values(), *saved["responses"].values()))
    assert len(saved["principles"]["principles"]) == 8
    assert summary["pool_correct"] == 1.0 and summary["judge"]["candidates"] == 8 * 3
    assert {"experience", "problem"} <= set(summary["judge"])
    # every prompt that was sampled: none but the gold context's boxes or states a held-out answer
    answers = {r["answer"] for r in held}
    gold_prompts = [t for texts in seen for t in texts if "The correct final answer is" in t]
    assert len(gold_prompts) == 8
    for texts in seen:
        for text in texts:
            if text in gold_prompts:
                continue
            boxed = set(re.findall(r"\\boxed\{([^}]*)\}", text))
            assert not boxed & answers, (boxed & answers, text)


def test_bad_settings_stop_before_any_model_loads(tmp_path):
    with pytest.raises(SystemExit, match="--pool nowhere.jsonl: not 'sampled', 'gold' or a pool.jsonl file"):
        probe.main(["--pool", "nowhere.jsonl", "--model", str(tmp_path / "no-model")])
    with pytest.raises(SystemExit, match="has no held-out problems here: give --eval-dataset"):
        probe.main(["--dataset", str(ROOT / "data" / "aime24.jsonl"), "--model", str(tmp_path / "no-model")])


def test_the_judge_alone_with_its_ranking_measures(tiny_model_dir, tmp_path):
    """--judge-only reports the judge without sampling any context: AUC and top-1 precision are in [0, 1], the
    top-1 share is over the problems that have a candidate of their family, and the question asked is named."""
    out = tmp_path / "judge.json"
    result = probe.main(["--model", str(tiny_model_dir), "--dataset", "synthetic:rules", "--levels", "1-2",
                         "--synthetic-size", "16", "--eval-size", "8", "--pool", "gold", "--judge-only",
                         "--relevance-question", "operation", "--out", str(out)])
    judge = json.loads(out.read_text())
    assert json.dumps(judge, sort_keys=True) == json.dumps(result["judge"], sort_keys=True)  # (NaN != NaN)
    assert judge["question"] == "operation" and judge["candidates"] == 8 * 3
    assert 0 < judge["problems_with_a_family_candidate"] <= 8
    for text in ("experience", "problem"):
        assert 0 <= judge[text]["auc"] <= 1 and 0 <= judge[text]["top1_precision"] <= 1
    rows, held = tmp_path / "rows.jsonl", tmp_path / "held.jsonl"
    for path, offset in ((rows, 10), (held, 50)):
        path.write_text("".join(json.dumps({"id": f"r{i}", "problem": f"What is {i} + {offset}?",
                                            "answer": str(i + offset)}) + "\n" for i in range(4)))
    with pytest.raises(SystemExit, match="no families to judge against"):
        probe.main(["--model", str(tiny_model_dir), "--dataset", str(rows), "--eval-dataset", str(held),
                    "--pool", "gold", "--judge-only", "--out", str(tmp_path / "j2.json")])
