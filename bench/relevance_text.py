"""What `--relevance-text problem` changes: the relevance judgement of the same (problem, candidate) pairs
from a saved pool, read with the candidate's shown solution (`experience`, the default) and without it
(`problem`). Reports the score distributions, the share accepted at each gamma, how often the two
settings agree, and the forward time and prompt tokens per pair; and the time of the default pairs with each
problem's part encoded once (share_prefix, what --share-prefill does in training) against the plain forward.

    python bench/relevance_text.py --pool runs/default/checkpoints/step-000010/pool.jsonl
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

import abstract  # noqa: E402
import models  # noqa: E402
import prompts  # noqa: E402
from pool import ExperiencePool  # noqa: E402
from reflect import shorten  # noqa: E402


def main() -> None:
    ap = common.parser(__doc__, "runs/bench/relevance_text.json")
    ap.add_argument("--pool", required=True, help="a pool.jsonl saved in a run's checkpoint")
    ap.add_argument("--candidates", type=int, default=3, help="K similar problems per problem")
    ap.add_argument("--attempt-tokens", type=int, default=160, help="budget of the shown solution")
    ap.add_argument("--gammas", type=float, nargs="+", default=[0.5, 0.9])
    args = ap.parse_args()

    pool = ExperiencePool()
    pool.load(args.pool)
    tokenizer = models.load_tokenizer(args.model)
    model = models.load_policy(args.model, torch.float32).eval()
    problems = {t.problem_id: t.problem for trials in pool.trials.values() for t in trials}
    pairs = {"experience": [], "problem": []}
    owners = []
    for pid, text in problems.items():
        for _, trials in pool.similar(text, args.candidates, exclude_id=pid):
            shown = abstract.best_trial(trials)
            pairs["experience"].append(prompts.relevance_request(
                text, shown.problem, shorten(shown.response, tokenizer, args.attempt_tokens)))
            pairs["problem"].append(prompts.relevance_request(text, shown.problem, None))
            owners.append(pid)
    result = {"pairs": len(pairs["problem"]), "problems": len(problems)}
    scores = {}
    for mode, texts in pairs.items():
        abstract.relevance_scores(model, tokenizer, texts[:4])  # warm-up
        t0 = time.perf_counter()
        scores[mode] = np.array(abstract.relevance_scores(model, tokenizer, texts))
        seconds = time.perf_counter() - t0
        tokens = np.mean([len(tokenizer(prompts.render_prompt(tokenizer, t, one_shot=False),
                                        add_special_tokens=False).input_ids) for t in texts])
        result[mode] = {"ms_per_pair": 1000 * seconds / len(texts), "prompt_tokens": float(tokens),
                        "score_mean": float(scores[mode].mean()),
                        "score_range": [float(scores[mode].min()), float(scores[mode].max())],
                        "accepted": {str(g): float((scores[mode] >= g).mean()) for g in args.gammas}}
    result["agreement"] = {str(g): float(((scores["experience"] >= g) == (scores["problem"] >= g)).mean())
                           for g in args.gammas}
    result["score_correlation"] = float(np.corrcoef(scores["experience"], scores["problem"])[0, 1])
    t0 = time.perf_counter()
    shared = np.array(abstract.relevance_scores(model, tokenizer, pairs["experience"], owners, share_prefix=True))
    result["shared"] = {"ms_per_pair": 1000 * (time.perf_counter() - t0) / len(owners),
                        "max_score_difference": float(np.abs(shared - scores["experience"]).max())}
    print(f"{result['pairs']} (problem, candidate) pairs from {result['problems']} problems in {args.pool}")
    print("| relevance text | prompt tokens | ms per pair | score mean [min, max] | "
          + " | ".join(f"accepted at gamma {g}" for g in args.gammas) + " |")
    print("|---|---|---|---|" + "---|" * len(args.gammas))
    for mode in pairs:
        r = result[mode]
        print(f"| {mode} | {r['prompt_tokens']:.0f} | {r['ms_per_pair']:.0f} | {r['score_mean']:.3f} "
              f"[{r['score_range'][0]:.3f}, {r['score_range'][1]:.3f}] | "
              + " | ".join(f"{r['accepted'][str(g)]:.3f}" for g in args.gammas) + " |")
    print("same verdict at gamma " + ", ".join(f"{g}: {result['agreement'][str(g)]:.3f}" for g in args.gammas)
          + f"; score correlation {result['score_correlation']:.2f}")
    print(f"experience pairs with each problem's part encoded once: {result['shared']['ms_per_pair']:.0f} ms per pair "
          f"({result['shared']['ms_per_pair'] / result['experience']['ms_per_pair']:.2f}x the plain forward), "
          f"scores within {result['shared']['max_score_difference']:.1e}")
    common.save_json(result, args.out)


if __name__ == "__main__":
    main()
