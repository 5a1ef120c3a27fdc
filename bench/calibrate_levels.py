"""Base pass rate of a model on each synthetic:arith level, at the training temperature, through the
training code path (same prompts, sampling and grader). Prints a table and writes JSON.

    python bench/calibrate_levels.py                      # embedded SmolLM2-135M, 32 problems x 4 samples
    python bench/calibrate_levels.py --problems 8 --samples 2   # smoke run
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

import data  # noqa: E402
import models  # noqa: E402
import prompts  # noqa: E402
import reward  # noqa: E402
from rollout import generate_completions  # noqa: E402


def main() -> None:
    ap = common.parser(__doc__, "runs/bench/calibrate_levels.json")
    ap.add_argument("--problems", type=int, default=32, help="problems per level")
    ap.add_argument("--samples", type=int, default=4, help="samples per problem")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()

    tokenizer = models.load_tokenizer(args.model)
    model = models.load_policy(args.model, torch.float32)
    eos = models.eos_token_ids(model, tokenizer)
    results = []
    for level in range(1, data.ARITH_LEVELS + 1):
        torch.manual_seed(level)
        rows = data.synthetic_arith("train", args.problems, seed=level, levels=[level])
        texts = [prompts.render_prompt(tokenizer, prompts.problem_request(r["problem"]), True)
                 for r in rows for _ in range(args.samples)]
        t0 = time.perf_counter()
        outs = generate_completions(model, tokenizer, texts, eos_ids=eos, max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature)
        problems = [r for r in rows for _ in range(args.samples)]
        rewards = reward.Rewarder().scores(problems, [o.text for o in outs], [o.truncated for o in outs])
        boxed = sum("\\boxed" in o.text for o in outs) / len(outs)
        results.append({"level": level, "pass_rate": sum(rewards) / len(rewards), "boxed_rate": boxed,
                        "samples": len(outs), "seconds": time.perf_counter() - t0,
                        "example": rows[0]["problem"]})
        print(f"level {level}: pass {results[-1]['pass_rate']:.3f}  boxed {boxed:.3f}  "
              f"({len(outs)} samples, {results[-1]['seconds']:.0f}s)  e.g. {rows[0]['problem']!r}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "temperature": args.temperature,
                                          "levels": results}, indent=2))


if __name__ == "__main__":
    main()
