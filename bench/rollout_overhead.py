"""Rollout overhead: lanpo's sampling phase (`rollout.generate_completions`: tokenize, batched generate,
EOS masks, decode) against a bare `model.generate` on the same prompts and settings. Alternating runs
from the same seed; the table gives generated tokens per second (tokens up to and including EOS) and
the ratio of the medians.

    python bench/rollout_overhead.py                 # embedded SmolLM2-135M, 32 prompts x 48 tokens, 3 rounds
    python bench/rollout_overhead.py --rounds 1 --prompts 8   # smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import models  # noqa: E402
import prompts  # noqa: E402
from grpo import completion_mask  # noqa: E402
from rollout import generate_completions  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.EMBEDDED)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="runs/bench/rollout_overhead.json")
    args = ap.parse_args()

    tokenizer = models.load_tokenizer(args.model)
    model = models.load_policy(args.model, torch.float32).eval()
    eos = models.eos_token_ids(model, tokenizer)
    rows = data.synthetic_arith("train", args.prompts, seed=0, levels=[1, 2, 3])
    texts = [prompts.render_prompt(tokenizer, prompts.problem_request(r["problem"]), True) for r in rows]

    def ours() -> int:
        outs = generate_completions(model, tokenizer, texts, eos_ids=eos, max_new_tokens=args.max_new_tokens,
                                    temperature=1.0, batch_size=len(texts))
        return sum(len(o.completion_ids) for o in outs)

    @torch.no_grad()
    def bare() -> int:
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
                             max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                             pad_token_id=tokenizer.pad_token_id)
        return int(completion_mask(out[:, enc.input_ids.shape[1]:], eos)[0].sum())

    rates = {"ours": [], "bare": []}
    for r in range(args.rounds):
        for name, fn in (("ours", ours), ("bare", bare)):
            torch.manual_seed(r)
            t0 = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - t0))
    result = {name: float(np.median(v)) for name, v in rates.items()}
    result["ratio"] = result["ours"] / result["bare"]
    result["runs"] = rates
    print(f"{args.prompts} prompts x {args.max_new_tokens} new tokens, {args.rounds} rounds")
    print(f"| | tokens/s (median) |\n|---|---|\n| generate_completions | {result['ours']:.1f} |\n"
          f"| bare model.generate | {result['bare']:.1f} |")
    print(f"ratio: {result['ratio']:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
