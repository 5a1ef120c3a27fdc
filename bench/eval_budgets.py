"""How many new tokens each benchmark needs: greedy responses of a model to a seeded subset of each benchmark,
generated once at the largest budget, give the share cut off at every smaller budget exactly (greedy decoding
with a smaller limit yields a prefix of the same response), and the accuracy at the largest one. evaluate.py's
per-benchmark defaults (`evaluate.TOKEN_BUDGETS`) come from this table: the smallest budget of the grid at which
the largest would finish at most --cut-share more of the responses.

    python bench/eval_budgets.py                                        # embedded SmolLM2-135M, 32 a benchmark
    python bench/eval_budgets.py --model qwen2.5-coder-0.5b --dtype bf16
    python bench/eval_budgets.py --limit 4 --budgets 16 32 --benchmarks gsm8k   # smoke run
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

import config  # noqa: E402
import cpu  # noqa: E402
import evaluate  # noqa: E402
import models  # noqa: E402
import scoring  # noqa: E402


def cut_share(lengths: list[int], ended: list[bool], budget: int) -> float:
    """The share of responses a `budget`-token limit cuts: those that had not ended within `budget` tokens (the
    responses were generated at a limit >= budget; `ended`: the response stopped by itself)."""
    return float(np.mean([not (done and n <= budget) for n, done in zip(lengths, ended)]))


def smallest_budget(shares: dict[int, float], most: float) -> int:
    """The smallest budget past which more tokens (up to the largest measured) would finish at most `most` more
    of the responses: its cut share is within `most` of the largest budget's. What the largest budget still cuts
    are responses that run away (loops) and that no budget of the grid would finish."""
    last = shares[max(shares)]
    return next(b for b, share in sorted(shares.items()) if share - last <= most)


def main(argv: list[str] | None = None) -> dict:
    ap = common.parser(__doc__, "runs/bench/eval_budgets.json")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--benchmarks", nargs="+", default=["synthetic:arith", "gsm8k", "math500", "amc23", "aime24"])
    ap.add_argument("--limit", type=int, default=32, help="problems a benchmark (seeded subset)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[48, 128, 256, 512, 1024])
    ap.add_argument("--cut-share", type=float, default=0.05,
                    help="the most responses that budgets past the chosen one may still finish")
    args = ap.parse_args(argv)

    precision, why = config.resolve_dtype(args.dtype, torch.cuda.is_available(), cpu.native_bf16(), sharded=False)
    tokenizer = models.load_tokenizer(args.model)
    model = models.load_for_inference(args.model, precision)  # as evaluate.py loads it
    eos = models.eos_token_ids(model, tokenizer)
    largest = max(args.budgets)
    cfg = dataclasses.replace(config.Config(), max_new_tokens=largest)
    result = {"model": args.model, "dtype": precision, "limit": args.limit, "budgets": sorted(args.budgets),
              "cut_share_most": args.cut_share, "benchmarks": {}}
    print(f"{args.model} ({precision}), {args.limit} problems a benchmark, greedy, zero-shot; share cut off at each "
          f"budget{'; ' + why if why else ''}")
    for name in args.benchmarks:
        rows = evaluate.load_benchmark(name, args.limit, 0, "test", [1, 2, 3], 48)
        t0 = time.perf_counter()
        records, summary = scoring.evaluate_rows(model, tokenizer, rows, "zero-shot", cfg, eos, progress=name)
        lengths = [r["lengths"][0] for r in records]
        ended = [not r["truncated"][0] for r in records]
        shares = {b: cut_share(lengths, ended, b) for b in sorted(args.budgets)}
        chosen = smallest_budget(shares, args.cut_share)
        result["benchmarks"][name] = {"cut_share": shares, "chosen": chosen, "accuracy_at_largest": summary["avg@1"],
                                      "median_length": float(np.median(lengths)), "seconds": time.perf_counter() - t0}
        print(f"  {name:16s} " + "  ".join(f"{b}: {s:.0%}" for b, s in shares.items())
              + f"  -> {chosen}; accuracy at {largest} {summary['avg@1']:.3f}, median length "
              f"{np.median(lengths):.0f}", flush=True)
    common.save_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
