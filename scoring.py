"""How a model scores on problems: sampling without feedback (zero-shot) or with it at test time (reflect: a
second turn that reviews the first attempt; abstract: principles from a saved *training* pool), grading,
and the metrics with their 95 % intervals. Training's periodic eval, evaluate.py and bench/ all call
`evaluate_rows`: one implementation.

Metrics: avg@k (mean accuracy of the k samples), unbiased pass@j (Chen et al. 2021) for j = 1, 2, 4, ... <= k,
maj@k (majority vote over extracted answers; ties count fractionally), each with its bootstrap interval over
problems (`<metric>_low`, `<metric>_high`); mean response length, truncation rate; in reflect mode the same
for turn 2 and the share of samples that flipped.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

import abstract
import math_grader
import prompts
import reflect
import stats
from pool import ExperiencePool
from rollout import generate_completions

MODES = ("zero-shot", "reflect", "abstract")


# ------------------------------------------------------------------------------------------------ metrics

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), in a stable product form."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_correct(answers: list[str | None], verdicts: list[float]) -> float:
    """maj@k: the most frequent extracted answer (normalised) wins; responses without an answer do not
    vote. Ties count fractionally: the share of correct answers among the tied winners (the expected
    score of a uniformly random tie-break). No votes at all scores 0."""
    votes: Counter = Counter()
    verdict_of: dict[str, float] = {}
    for answer, verdict in zip(answers, verdicts):
        if answer is None:
            continue
        key = math_grader.normalize(answer)
        votes[key] += 1
        verdict_of.setdefault(key, verdict)
    if not votes:
        return 0.0
    top = max(votes.values())
    winners = [key for key, count in votes.items() if count == top]
    return sum(verdict_of[w] for w in winners) / len(winners)


def summarize(records: list[dict], samples: int) -> dict[str, float]:
    """Benchmark-level metrics from per-problem records (each with `verdicts`, `lengths`, `truncated`,
    `answers`); each accuracy with its 95 % bootstrap interval over problems (`_low`, `_high`)."""
    if not records:
        return {}
    out = {"problems": float(len(records))}
    for key, scores in per_problem_scores(records, samples).items():
        out[key], out[f"{key}_low"], out[f"{key}_high"] = stats.interval([scores])
    if "rewards" in records[0]:  # --reward module:function: its mean beside the grader's accuracy
        out["reward"], out["reward_low"], out["reward_high"] = stats.interval(
            [[float(np.mean(r["rewards"])) for r in records]])
    out["response_len"] = float(np.mean([np.mean(r["lengths"]) for r in records]))
    out["truncated"] = float(np.mean([np.mean(r["truncated"]) for r in records]))
    return out


def per_problem_scores(records: list[dict], samples: int) -> dict[str, list[float]]:
    """Each accuracy metric's score per problem (their means are the benchmark's metrics): avg@k, pass@j for
    j = 1, 2, 4, ... <= k, maj@k."""
    out = {f"avg@{samples}": [float(np.mean(r["verdicts"])) for r in records]}
    j = 1
    while j <= samples:
        out[f"pass@{j}"] = [pass_at_k(samples, int(sum(r["verdicts"])), j) for r in records]
        j *= 2
    out[f"maj@{samples}"] = [majority_correct(r["answers"], r["verdicts"]) for r in records]
    return out


# ------------------------------------------------------------------------------------------------ running

def _sample(model, tokenizer, texts: list[str], cfg, temperature: float, eos_ids: list[int], progress: str):
    return generate_completions(model, tokenizer, texts, eos_ids=eos_ids, max_new_tokens=cfg.max_new_tokens,
                                temperature=temperature or 1.0, top_p=cfg.top_p, greedy=temperature == 0,
                                batch_size=cfg.gen_batch, share_prefill=cfg.share_prefill,
                                compiled=cfg.compile_decoding, progress=progress)


def _record(row: dict, prompt: str, outs) -> dict:
    """One problem's turn: the exact prompt, the responses, their extracted answers and verdicts."""
    verdicts = [math_grader.grade(o.text, row["answer"], truncated=o.truncated) for o in outs]
    return {"id": row["id"], "problem": row["problem"], "gold": row["answer"], "prompt": prompt,
            "responses": [o.text for o in outs],
            "answers": [math_grader.extract_answer(o.text, o.truncated) for o in outs],
            "verdicts": verdicts, "lengths": [len(o.completion_ids) for o in outs],
            "truncated": [o.truncated for o in outs]}


def add_rewards(records: list[dict], rows: list[dict], rewarder, prefix: str = "") -> None:
    """Each record's `rewards` (or `turn2_rewards`): the responses scored by a --reward function."""
    texts = [text for r in records for text in r[prefix + "responses"]]
    problems = [row for row, r in zip(rows, records) for _ in r[prefix + "responses"]]
    cut = [flag for r in records for flag in r[prefix + "truncated"]]
    scores = iter(rewarder.scores(problems, texts, cut))
    for r in records:
        r[prefix + "rewards"] = [next(scores) for _ in r[prefix + "responses"]]


def turn2_prompt(tokenizer, record: dict, j: int, cfg) -> str:
    """Sample j's reflection prompt: its own first attempt, then the problem's other first attempts up to
    --reflect-attempts (the newest-first order training shows), built as training builds it; the labels are
    read only by the leaky ablations."""
    order = [j] + [i for i in range(len(record["responses"])) if i != j]
    shown = order[:cfg.reflect_attempts]
    return reflect.reflection_prompt(tokenizer, record["problem"], [record["responses"][i] for i in shown],
                                     attempt_tokens=cfg.attempt_tokens, one_shot=cfg.one_shot, mode=cfg.reflect_mode,
                                     labels=lambda: ([record["verdicts"][i] for i in shown], record["gold"]))[0]


def evaluate_rows(model, tokenizer, rows: list[dict], mode: str, cfg, eos_ids: list[int],
                  pool: ExperiencePool | None = None, first_turn: list[dict] | None = None, rewarder=None,
                  progress: str = "", samples: int = 1,
                  temperature: float = 0.0) -> tuple[list[dict], dict[str, float]]:
    """Per-problem records and the summary for one benchmark in one mode: `samples` responses a problem at
    `temperature` (0: greedy), every other setting from cfg (config.Config: training's, or evaluate.py's
    flags, which are the same fields), built by training's prompt builders. In `reflect` mode each record
    also holds the second turn (`turn2_*`), and the summary the turn-2 metrics and the flips; turn 1 is
    a zero-shot pass, taken from `first_turn` (zero-shot records of the same rows and seed) when given.
    With a `rewarder` (reward.Rewarder of a --reward function) every response is also scored by it.
    progress: a label for progress bars over the sampling (none when empty)."""
    if temperature == 0 and samples != 1:
        raise SystemExit("greedy decoding (--temperature 0) gives one distinct sample: use --samples 1")
    k = samples
    lessons: dict[str, str] = {}
    if mode == "abstract":
        if pool is None:
            raise SystemExit("--mode abstract needs --pool (a pool.jsonl saved by a training run)")
        lessons, _ = abstract.lessons_for(model, tokenizer, pool, rows, {}, 0, cfg, eos_ids)  # a fresh cache
    texts = []
    for row in rows:
        request = prompts.problem_request(row["problem"])
        if row["id"] in lessons:
            request = prompts.abstraction_request(row["problem"], lessons[row["id"]], raw=cfg.abstract_mode == "raw")
        texts.append(prompts.render_prompt(tokenizer, request, cfg.one_shot))
    if mode == "reflect" and first_turn is not None:
        records = [dict(r) for r in first_turn]
    else:
        outs = _sample(model, tokenizer, [t for t in texts for _ in range(k)], cfg, temperature, eos_ids, progress)
        records = [_record(row, text, outs[i * k:(i + 1) * k]) for i, (row, text) in enumerate(zip(rows, texts))]
        if rewarder is not None:
            add_rewards(records, rows, rewarder)
    for r in records:
        r["lessons"] = lessons.get(r["id"], "")
    summary = summarize(records, k)
    if mode == "abstract":
        summary["with_lessons"] = float(len(lessons)) / len(rows)

    if mode == "reflect":  # turn 2: each sample reviews its own first attempt first (never told if it was right)
        second = [turn2_prompt(tokenizer, r, j, cfg) for r in records for j in range(len(r["responses"]))]
        outs2 = _sample(model, tokenizer, second, cfg, temperature, eos_ids, progress and f"{progress}, turn 2")
        turn2 = [_record(row, "", outs2[i * k:(i + 1) * k]) for i, row in enumerate(rows)]
        if rewarder is not None:
            add_rewards(turn2, rows, rewarder)
        keys = ("responses", "answers", "verdicts", "lengths", "truncated") + (("rewards",) if rewarder else ())
        for i, (r, t) in enumerate(zip(records, turn2)):
            for key in keys:
                r[f"turn2_{key}"] = t[key]
            r["turn2_prompts"] = second[i * k:(i + 1) * k]  # one per sample: each shows its own first attempt
        summary.update(turn2_summary(records, k))
    return records, summary


def turn2_summary(records: list[dict], samples: int) -> dict[str, float]:
    """Turn-2 metrics of reflect mode, and the share of samples that flipped right->wrong / wrong->right."""
    turn2 = [{k.removeprefix("turn2_"): v for k, v in r.items() if k.startswith("turn2_")} for r in records]
    out = {f"turn2_{key}": v for key, v in summarize(turn2, samples).items() if key != "problems"}
    pairs = [(b > 0, a > 0) for r in records for b, a in zip(r["verdicts"], r["turn2_verdicts"])]
    out["flip_right_to_wrong"] = sum(b and not a for b, a in pairs) / len(pairs)
    out["flip_wrong_to_right"] = sum(a and not b for b, a in pairs) / len(pairs)
    return out


