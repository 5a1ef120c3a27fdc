"""Decoding into room kept behind the prompt's KV cache (`rollout.ReservedLayer`, what lanpo does) against
transformers' DynamicCache, which concatenates the whole cache every token (copying it: O(length) a token).
lanpo's sampling path (`rollout.generate_completions`, rows-first linear layers on CPU) on two prompt sets:

- groups: a LANPO step's sampling call, B problems x G rows, half of each group on the plain prompt and
  half on a reflection prompt that shows an earlier attempt of --attempt-tokens tokens (sampled);
- long greedy rows: a few greedy rows on long prompts (two earlier attempts each), as the principles are
  decoded (few rows: every step reads the weights for little work).

Passes alternate the two caches from the same seed; the table gives each one's seconds a call (medians), the
ratio with a 95 % bootstrap interval, and whether the completions were the same (they must be).

    python bench/kv_room.py                                 # embedded SmolLM2-135M, 5 passes
    python bench/kv_room.py --passes 1 --new-tokens 8       # smoke run
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

import cpu  # noqa: E402
import data  # noqa: E402
import models  # noqa: E402
import prompts  # noqa: E402
import rollout  # noqa: E402
import stats  # noqa: E402
from reflect import reflection_prompt  # noqa: E402


def main() -> None:
    ap = common.parser(__doc__, "runs/bench/kv_room.json")
    ap.add_argument("--problems", type=int, default=4, help="B of the groups set")
    ap.add_argument("--group-size", type=int, default=4, help="G of the groups set")
    ap.add_argument("--greedy-rows", type=int, default=2, help="rows of the long greedy set")
    ap.add_argument("--attempt-tokens", type=int, default=128, help="an earlier attempt shown in a prompt")
    ap.add_argument("--new-tokens", type=int, default=32, help="sampled tokens (the greedy rows: 1.5x)")
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()

    tokenizer = models.load_tokenizer(args.model)
    model = models.load_policy(args.model, torch.float32).eval()
    cpu.speed_up(model)
    eos = models.eos_token_ids(model, tokenizer)
    rows = data.synthetic_arith("train", args.problems, seed=0, levels=[1, 2, 3])
    plain = [prompts.render_prompt(tokenizer, prompts.problem_request(r["problem"]), True) for r in rows]
    torch.manual_seed(0)  # the earlier attempts: sampled once, long enough to fill the attempt budget
    attempts = rollout.generate_completions(model, tokenizer, plain + plain, eos_ids=[],
                                            max_new_tokens=args.attempt_tokens)
    half = args.group_size // 2
    groups = [t for i, r in enumerate(rows) for t in [plain[i]] * half + [reflection_prompt(
        tokenizer, r["problem"], [attempts[i].text], attempt_tokens=args.attempt_tokens, one_shot=True)[0]] * (
        args.group_size - half)]
    long = [reflection_prompt(tokenizer, r["problem"], [attempts[i].text, attempts[i + len(rows)].text],
                              attempt_tokens=args.attempt_tokens, one_shot=True)[0]
            for i, r in enumerate(rows[:args.greedy_rows])]
    sets = {f"groups ({args.problems} x {args.group_size}, sampled)": (groups, args.new_tokens, False),
            f"long greedy rows ({args.greedy_rows})": (long, args.new_tokens * 3 // 2, True)}
    caches = {"room": rollout.reserved_cache, "concatenated": lambda room: DynamicCache()}

    result = {}
    print(f"{args.passes} alternating passes; seconds a generate_completions call (median)")
    print("| prompts | prompt tokens (mean) | new tokens | room s | concatenated s | ratio [95 % CI] | same |")
    print("|---|---|---|---|---|---|---|")
    for name, (texts, new_tokens, greedy) in sets.items():
        seconds = {side: [] for side in caches}
        outs = {}
        for p in range(args.passes):
            for side, make in (caches.items() if p % 2 == 0 else reversed(caches.items())):
                rollout.reserved_cache = make
                torch.manual_seed(p)
                t0 = time.perf_counter()
                out = rollout.generate_completions(model, tokenizer, texts, eos_ids=eos, max_new_tokens=new_tokens,
                                                   greedy=greedy)
                seconds[side].append(time.perf_counter() - t0)
                outs.setdefault(p, {})[side] = [o.completion_ids.tolist() for o in out]
        rollout.reserved_cache = caches["room"]
        same = all(o["room"] == o["concatenated"] for o in outs.values())
        low, high = stats.median_ratio_interval(seconds["room"], seconds["concatenated"])
        ratio = float(np.median(seconds["room"]) / np.median(seconds["concatenated"]))
        prompt_tokens = float(np.mean([len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]))
        result[name] = {"seconds": seconds, "ratio": ratio, "ratio_95": [low, high], "same": same,
                        "prompt_tokens": prompt_tokens, "new_tokens": new_tokens}
        print(f"| {name} | {prompt_tokens:.0f} | {new_tokens} | {np.median(seconds['room']):.2f} | "
              f"{np.median(seconds['concatenated']):.2f} | {ratio:.2f} [{low:.2f}, {high:.2f}] | {same} |", flush=True)
        if not same:
            raise SystemExit(f"{name}: the two caches sampled different completions")
    common.save_json(result, args.out)


if __name__ == "__main__":
    main()
