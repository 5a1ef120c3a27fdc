"""Where a self-distillation teacher pulls the student. For the from-scratch responses of a saved pool that
ended on their own (shorter than --max-new-tokens), compare the model on the plain prompt (the student) with
the same model shown its newest earlier attempt in a reflection prompt (the teacher that --self-distill-coef
builds): the probability of ending the turn right after the response, and the per-token reverse KL over
the full vocabulary, at the end-of-turn position and elsewhere.

    python bench/teacher_eos.py runs/bench/feedback-grad-lr2e-5/lanpo/checkpoints/step-000010/pool.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import config  # noqa: E402
import distill  # noqa: E402
import forwards  # noqa: E402
import lanpo  # noqa: E402
import models  # noqa: E402
import rollout  # noqa: E402
from pool import ExperiencePool  # noqa: E402


def pairs(pool_path: Path, tokenizer, cfg: config.Config) -> list[tuple[str, str, str]]:
    """(plain prompt, teacher prompt, response) for every from-scratch trial whose problem was tried at an
    earlier step. The saved pool is replayed step by step, and lanpo.build_prompts makes each problem's
    prompts from the trials of earlier steps, as training did (cfg needs --self-distill-coef > 0)."""
    saved = ExperiencePool(cfg.pool_per_problem, cfg.pool_max_problems)
    saved.load(pool_path)  # names the line that is not a trial
    trials = sorted((t for ts in saved.trials.values() for t in ts), key=lambda t: t.step)
    replay, out = ExperiencePool(cfg.pool_per_problem, cfg.pool_max_problems), []
    for _, at_step in itertools.groupby(trials, key=lambda t: t.step):
        at_step = list(at_step)
        built = {}  # problem id -> its prompts this step, built once for all its trials
        for t in at_step:
            if t.kind != "scratch" or not replay.attempts(t.problem_id, 1):
                continue
            if t.problem_id not in built:
                problem = {"id": t.problem_id, "problem": t.problem, "answer": ""}
                built[t.problem_id] = lanpo.build_prompts(tokenizer, [problem], replay, {}, cfg)[0]
            out.append((built[t.problem_id].plain, built[t.problem_id].teacher, t.response))
        replay.add(at_step)
    return out


@torch.no_grad()
def log_probs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float) -> torch.Tensor:
    """Log-probs [C, V] at the positions that predict each completion token."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = forwards.completion_logits(model, ids, torch.ones_like(ids), len(completion_ids), temperature)
    return torch.log_softmax(logits[0].float(), dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pool", type=Path, help="a pool.jsonl from a run's checkpoint")
    ap.add_argument("--model", default=config.Config.model, help="the model to probe (default: the embedded one)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/bench/teacher_eos.json", help="per-response numbers")
    args = ap.parse_args()
    cfg = config.parse_config(["--self-distill-coef", "1"])  # the default run's settings, with a teacher
    tokenizer = models.load_tokenizer(args.model)
    model = models.load_policy(args.model, torch.float32).eval()
    eos = models.eos_token_ids(model, tokenizer)
    end_of_turn = models.end_of_turn_id(tokenizer, eos)
    rows = []
    for plain, teacher, response in pairs(args.pool, tokenizer, cfg):
        completion = rollout.token_ids(tokenizer, response).tolist()
        if len(completion) >= cfg.max_new_tokens:  # truncated: it never chose to stop
            continue
        completion = completion + [end_of_turn]
        student_lp = log_probs(model, rollout.token_ids(tokenizer, plain).tolist(), completion, cfg.temperature)
        teacher_lp = log_probs(model, rollout.token_ids(tokenizer, teacher).tolist(), completion, cfg.temperature)
        kl = distill.divergence(student_lp, teacher_lp, "reverse_kl")
        rows.append({"p_end_student": student_lp[-1, eos].exp().sum().item(),
                     "p_end_teacher": teacher_lp[-1, eos].exp().sum().item(),
                     "kl_end": kl[-1].item(), "kl_body": kl[:-1].mean().item()})
    if not rows:
        raise SystemExit(f"{args.pool}: no from-scratch trial that ended on its own has an earlier attempt")

    def mean(key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    lower = sum(r["p_end_teacher"] < r["p_end_student"] for r in rows)
    print(f"{len(rows)} from-scratch responses that ended on their own, each with an earlier attempt")
    print("| | student (plain prompt) | teacher (reflection prompt) |")
    print("|---|---|---|")
    print(f"| P(end of turn) after the response, mean | {mean('p_end_student'):.3f} | {mean('p_end_teacher'):.3f} |")
    print(f"teacher gives ending a lower probability in {lower}/{len(rows)} responses")
    print(f"reverse KL(student || teacher) per token: {mean('kl_end'):.3f} nats at the end-of-turn position, "
          f"{mean('kl_body'):.3f} elsewhere")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"pool": str(args.pool), "model": args.model, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
