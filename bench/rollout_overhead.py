"""Rollout overhead: lanpo's sampling phase (`rollout.generate_completions`: tokenize, shared prefill,
batched generate, EOS masks, decode) against a bare `model.generate` on the same prompts and settings,
on three prompt sets:

- distinct: N different one-shot problem prompts (they share only the chat template and worked example);
- groups: N/G problems x G samples of the plain prompt (a GRPO step's rollouts);
- reflection groups: problems x G = 8 samples of a reflection prompt that shows an earlier attempt of
  about --attempt-tokens tokens (the long prompts LANPO repeats within a group).

"ours" is the sampling as `lanpo.py` runs it: on CPU with its rows-first linear layers
(`--cpu-rows-first-matmul`, on by default there); "bare" is `model.generate` on the model as Hugging Face
builds it. `--no-rows-first` times ours without them (the sampling path alone). Rounds alternate ours and
bare from the same seed; the table gives generated tokens per second (tokens
up to and including EOS), the ratio of the medians, and its 95 % bootstrap interval (rounds resampled).

    python bench/rollout_overhead.py                 # embedded SmolLM2-135M, 32 prompts x 48 tokens, 5 rounds
    python bench/rollout_overhead.py --rounds 1 --prompts 8   # smoke run
    python bench/rollout_overhead.py --no-rows-first          # both sides on plain nn.Linear layers
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

import cpu  # noqa: E402
import data  # noqa: E402
import models  # noqa: E402
import prompts  # noqa: E402
import stats  # noqa: E402
from grpo import completion_mask  # noqa: E402
from reflect import reflection_prompt  # noqa: E402
from rollout import generate_completions  # noqa: E402


def main() -> None:
    ap = common.parser(__doc__, "runs/bench/rollout_overhead.json")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per generate call in every set")
    ap.add_argument("--group-size", type=int, default=4, help="G of the groups set")
    ap.add_argument("--reflect-group-size", type=int, default=8, help="G of the reflection set")
    ap.add_argument("--attempt-tokens", type=int, default=160, help="earlier attempt shown in a reflection prompt")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sets", nargs="+", default=["distinct", "groups", "reflection"],
                    choices=["distinct", "groups", "reflection"], help="prompt sets to time")
    ap.add_argument("--rows-first", action=argparse.BooleanOptionalAction, default=True,
                    help="ours with lanpo's rows-first linear layers (on CPU, as lanpo.py runs by default)")
    args = ap.parse_args()

    tokenizer = models.load_tokenizer(args.model)
    model = models.load_policy(args.model, torch.float32).eval()
    eos = models.eos_token_ids(model, tokenizer)
    rows = data.synthetic_arith("train", args.prompts, seed=0, levels=[1, 2, 3])
    plain = [prompts.render_prompt(tokenizer, prompts.problem_request(r["problem"]), True) for r in rows]
    n_reflect = args.prompts // args.reflect_group_size
    torch.manual_seed(0)  # the earlier attempts: sampled once, long enough to fill the attempt budget
    attempts = generate_completions(model, tokenizer, plain[:n_reflect], eos_ids=[], temperature=1.0,
                                    max_new_tokens=args.attempt_tokens)
    reflect = [reflection_prompt(tokenizer, r["problem"], [a.text], attempt_tokens=args.attempt_tokens,
                                 one_shot=True)[0] for r, a in zip(rows, attempts)]
    sets = {"distinct": ("distinct", plain),
            "groups": (f"groups (G = {args.group_size})",
                       [t for t in plain[:args.prompts // args.group_size] for _ in range(args.group_size)]),
            "reflection": (f"reflection groups (G = {args.reflect_group_size})",
                           [t for t in reflect for _ in range(args.reflect_group_size)])}

    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    fast = args.rows_first and model.device.type == "cpu"

    def use_linear(cls) -> None:  # what cpu.rows_first_linears does, reversibly: bare runs on nn.Linear
        for m in linears:
            m.__class__ = cls

    def ours(texts: list[str], share_prefill: bool = True, greedy: bool = False) -> int:
        use_linear(cpu.RowsFirstLinear if fast else torch.nn.Linear)
        outs = generate_completions(model, tokenizer, texts, eos_ids=eos, max_new_tokens=args.max_new_tokens,
                                    temperature=1.0, greedy=greedy, batch_size=len(texts), share_prefill=share_prefill)
        return sum(len(o.completion_ids) for o in outs)

    @torch.no_grad()
    def bare(texts: list[str]) -> int:
        use_linear(torch.nn.Linear)
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
                             max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                             pad_token_id=tokenizer.pad_token_id)
        return int(completion_mask(out[:, enc.input_ids.shape[1]:], eos)[0].sum())

    result = {}
    print(f"{args.prompts} prompts per call x {args.max_new_tokens} new tokens, {args.rounds} rounds; "
          f"ours {'with' if fast else 'without'} rows-first linear layers")
    print("| prompts | prompt tokens (mean) | generate_completions tok/s | bare generate tok/s | ratio [95 % CI] |")
    print("|---|---|---|---|---|")
    for name, texts in (sets[key] for key in args.sets):
        rates = {"ours": [], "bare": []}
        for r in range(args.rounds):
            for side, fn in (("ours", ours), ("bare", bare)):
                torch.manual_seed(r)
                t0 = time.perf_counter()
                tokens = fn(texts)
                rates[side].append(tokens / (time.perf_counter() - t0))
        low, high = stats.median_ratio_interval(rates["ours"], rates["bare"])
        prompt_tokens = float(np.mean([len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]))
        result[name] = {"ours": float(np.median(rates["ours"])), "bare": float(np.median(rates["bare"])),
                        "ratio_95": [low, high], "prompt_tokens": prompt_tokens, "runs": rates}
        result[name]["ratio"] = result[name]["ours"] / result[name]["bare"]
        print(f"| {name} | {prompt_tokens:.0f} | {result[name]['ours']:.1f} | {result[name]['bare']:.1f} | "
              f"{result[name]['ratio']:.2f} [{low:.2f}, {high:.2f}] |", flush=True)
    # What generate_completions adds around generate (tokenize, masks, decode), without generate's noise:
    # the distinct set again with model.generate replaced by a replay of a recorded output. Prefill sharing
    # off: its forwards are generate's own prefill moved before the call, model work, not bookkeeping.
    enc = tokenizer(plain, return_tensors="pt", padding=True, add_special_tokens=False)
    t0 = time.perf_counter()
    recorded = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=args.max_new_tokens,
                              eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    generate_s = time.perf_counter() - t0
    model.generate = lambda **kwargs: recorded
    t0 = time.perf_counter()
    for _ in range(20):  # greedy: a replay calls no logits processor, so no sampler log-probs are collected
        ours(plain, share_prefill=False, greedy=True)
    around_s = (time.perf_counter() - t0) / 20
    del model.generate
    result["around_generate_s"], result["generate_s"] = around_s, generate_s
    print(f"around generate (distinct set, generate replayed): {1000 * around_s:.1f} ms per call, "
          f"{100 * around_s / generate_s:.2f} % of one generate call ({generate_s:.1f} s)")
    common.save_json(result, args.out)


if __name__ == "__main__":
    main()
