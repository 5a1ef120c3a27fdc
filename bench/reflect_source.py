"""Which earlier attempt should a reflection prompt show (--reflect-source)? On a finished run (its config,
the pool of its last checkpoint and its final model): every problem whose newest trial is a feedback rollout
gets two reflection prompts, one showing that newest trial (`any`) and one showing its newest from-scratch trial
(`scratch`); the final model samples --samples completions of each at the run's temperature and budget. Where
the newest trial is from scratch the two choices show the same attempt, so only the problems where they differ
are measured.

Reported per choice, each with its 95 % interval over problems: the reflection reward, the share of correct
reflections where the shown attempt was wrong (wrong -> right) and of wrong ones where it was right
(right -> wrong); and scratch - any, paired on the problems. JSON under --out.

    python bench/reflect_source.py --run runs/default --samples 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

import config  # noqa: E402
import cpu  # noqa: E402
import data  # noqa: E402
import math_grader  # noqa: E402
import models  # noqa: E402
import reflect  # noqa: E402
import rundir  # noqa: E402
import stats  # noqa: E402
from pool import ExperiencePool  # noqa: E402
from rollout import generate_completions  # noqa: E402

SOURCES = {"any": None, "scratch": "scratch"}  # --reflect-source -> the kind pool.attempts reads


def per_problem(verdicts: list[float], shown_reward: float) -> dict[str, float | None]:
    """One problem's scores from its reflections' verdicts and the reward of the attempt they were shown."""
    mean = sum(verdicts) / len(verdicts)
    return {"reward": mean, "wrong_to_right": None if shown_reward > 0 else mean,
            "right_to_wrong": 1 - mean if shown_reward > 0 else None}


def summary(scores: list[dict[str, float | None]]) -> dict[str, list[float] | int]:
    """Each score's [mean, low, high] over the problems where it is defined, and how many those are."""
    out = {}
    for key in ("reward", "wrong_to_right", "right_to_wrong"):
        values = [s[key] for s in scores if s[key] is not None]
        out[key] = list(stats.interval([values])) if values else None
        out[f"{key}_problems"] = len(values)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a finished run directory (config.json, checkpoints/, final/)")
    ap.add_argument("--samples", type=int, default=8, help="reflections sampled per problem and choice")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench/reflect_source.json")
    args = ap.parse_args()

    run = Path(args.run)
    saved = json.loads((run / "config.json").read_text())
    cfg = config.Config(**{f.name: saved[f.name] for f in dataclasses.fields(config.Config) if f.name in saved})
    checkpoints = rundir.checkpoint_dirs(run)
    if not checkpoints or not (run / "final").is_dir():
        raise SystemExit(f"{run}: needs a checkpoint (its pool.jsonl) and final/ (a finished run)")
    pool = ExperiencePool(cfg.pool_per_problem, cfg.pool_max_problems)
    pool.load(checkpoints[-1] / "pool.jsonl")
    gold = {r["id"]: r["answer"] for r in data.load_rows(cfg)[0]}

    tokenizer = models.load_tokenizer(str(run / "final"))
    model = models.load_policy(str(run / "final"), torch.float32).eval()
    if not torch.cuda.is_available():
        cpu.speed_up(model, cfg.cpu_rows_first_matmul)
    eos_ids = models.eos_token_ids(model, tokenizer)

    measured = [pid for pid in pool.trials
                if pool.attempts(pid, 1)[0].kind != "scratch" and pool.attempts(pid, 1, "scratch")]
    shown = {name: [pool.attempts(pid, cfg.reflect_attempts, kind) for pid in measured]
             for name, kind in SOURCES.items()}
    result = {"run": str(run), "checkpoint": checkpoints[-1].name, "samples": args.samples,
              "problems_in_pool": len(pool.trials), "problems_measured": len(measured)}
    scores = {}
    for name, attempts in shown.items():
        texts = [reflect.reflection_prompt(tokenizer, pool.trials[pid][0].problem, [t.response for t in trials],
                                           attempt_tokens=cfg.attempt_tokens, one_shot=cfg.one_shot)[0]
                 for pid, trials in zip(measured, attempts)]
        torch.manual_seed(args.seed)
        outs = generate_completions(model, tokenizer, [t for t in texts for _ in range(args.samples)], eos_ids=eos_ids,
                                    max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                    batch_size=cfg.gen_batch, share_prefill=cfg.share_prefill)
        verdicts = math_grader.grade_batch([o.text for o in outs], [gold[pid] for pid in measured
                                                                    for _ in range(args.samples)],
                                           truncated=[o.truncated for o in outs])
        scores[name] = [per_problem(verdicts[i * args.samples:(i + 1) * args.samples], trials[0].reward)
                        for i, trials in enumerate(attempts)]
        result[name] = {**summary(scores[name]),
                        "shown_kinds": {k: sum(t[0].kind == k for t in attempts) for k in ("scratch", "reflect",
                                                                                          "abstract")},
                        "shown_correct": sum(t[0].reward > 0 for t in attempts)}
    diff = stats.paired_difference([[s["reward"] for s in scores["scratch"]]], [[s["reward"] for s in scores["any"]]])
    result["scratch_minus_any_reward"] = diff
    print(f"{len(measured)} of {len(pool.trials)} problems: newest trial a feedback rollout, a from-scratch one "
          f"too ({args.samples} reflections each per choice)")
    for name in SOURCES:
        r = result[name]
        line = [f"--reflect-source {name:7s} shown correct {r['shown_correct']}/{len(measured)}"]
        for key in ("reward", "wrong_to_right", "right_to_wrong"):
            if r[key]:
                line.append(f"{key} {stats.fmt(*r[key])} (n={r[f'{key}_problems']})")
        print("; ".join(line))
    print(f"reward scratch - any {stats.fmt_diff(diff)} (paired, p {diff['p']:.3f})")
    common.save_json(result, args.out, 1)


if __name__ == "__main__":
    main()
