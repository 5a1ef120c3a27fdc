"""The update's prompt prefix tree with its second level in column ranges (`forwards.prompt_column_cuts`, as
many as `forwards.prompt_chunk_count` picks: what lanpo does) against one forward over every distinct prompt
padded to the longest: the forward and backward of one micro-batch as the update runs it, on a LANPO-like
micro-batch of the embedded model (per problem: plain-prompt rows, a reflection prompt showing an earlier
attempt of --attempt-tokens tokens, an abstraction prompt with a principles text), completions of random
length up to --new-tokens. Repetitions alternate the two; ratio of the medians with a 95 % bootstrap
interval, and the largest log-prob difference (float rounding only).

    python bench/prompt_ranges.py                                   # 32 new tokens, 6 repetitions
    python bench/prompt_ranges.py --new-tokens 128
    python bench/prompt_ranges.py --repetitions 1 --new-tokens 8    # smoke run
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

import cpu  # noqa: E402
import data  # noqa: E402
import forwards  # noqa: E402
import models  # noqa: E402
import prompts  # noqa: E402
import stats  # noqa: E402
from reflect import reflection_prompt  # noqa: E402
from rollout import Completion, generate_completions, pack  # noqa: E402


def main() -> None:
    ap = common.parser(__doc__, "runs/bench/prompt_ranges.json")
    ap.add_argument("--problems", type=int, default=2, help="problems in the micro-batch (4 rows each)")
    ap.add_argument("--attempt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--most", type=int, default=4, help="--update-chunks")
    ap.add_argument("--repetitions", type=int, default=6)
    args = ap.parse_args()

    tokenizer = models.load_tokenizer(args.model)
    model = models.load_policy(args.model, torch.float32)
    cpu.speed_up(model)
    rows = data.synthetic_arith("train", args.problems, seed=1, levels=[1, 2, 3])
    plain = [prompts.render_prompt(tokenizer, prompts.problem_request(r["problem"]), True) for r in rows]
    torch.manual_seed(0)
    attempts = generate_completions(model, tokenizer, plain, eos_ids=[], max_new_tokens=args.attempt_tokens)
    lessons = "1. Write the quantities down. 2. Check each operation against the question. 3. Recompute."
    texts = []
    for r, p, a in zip(rows, plain, attempts):
        texts += [p, p, reflection_prompt(tokenizer, r["problem"], [a.text], attempt_tokens=args.attempt_tokens,
                                          one_shot=True)[0],
                  prompts.render_prompt(tokenizer, prompts.abstraction_request(r["problem"], lessons), True)]
    g = torch.Generator().manual_seed(0)
    completions = [Completion(tokenizer(t, add_special_tokens=False, return_tensors="pt").input_ids[0],
                              torch.randint(3, len(tokenizer) - 1, (int(torch.randint(1, args.new_tokens + 1, (1,),
                                                                                       generator=g)),), generator=g),
                              False, "") for t in texts]
    ids, attn, cmask = pack(completions, tokenizer.pad_token_id, "cpu")
    n_completion = cmask.shape[1]
    chunks = forwards.chunk_count(cmask.sum(dim=1), args.most)
    ranges = forwards.prompt_chunk_count(ids, attn, n_completion, args.most)
    if ranges == 1:
        raise SystemExit("prompt_chunk_count picks one range for this micro-batch: nothing to compare")
    model.train()

    def forward_backward(prompt_chunks: int) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logits = forwards.completion_logits(model, ids, attn, n_completion, share_prompts=True, chunks=chunks,
                                            prompt_chunks=prompt_chunks)
        logps, _ = forwards.selective_log_softmax(logits, ids[:, -n_completion:])
        (logps * cmask).sum().backward()
        return time.perf_counter() - t0, logps.detach()

    seconds, logps = {ranges: [], 1: []}, {}
    for rep in range(args.repetitions):
        for side in ((ranges, 1) if rep % 2 == 0 else (1, ranges)):
            s, logps[side] = forward_backward(side)
            seconds[side].append(s)
    lengths = attn[:, :ids.shape[1] - n_completion].sum(dim=1)
    low, high = stats.median_ratio_interval(seconds[ranges], seconds[1])
    ratio = float(np.median(seconds[ranges]) / np.median(seconds[1]))
    diff = float((logps[ranges] - logps[1]).abs().max())
    print(f"{len(texts)} rows, prompts of {int(lengths.min())}-{int(lengths.max())} tokens, completions up to "
          f"{n_completion}; {chunks} completion groups; prompt ranges picked: {ranges}")
    print(f"forward + backward: {np.median(seconds[ranges]):.2f} s in {ranges} ranges, {np.median(seconds[1]):.2f} s "
          f"in one; ratio {ratio:.2f} [{low:.2f}, {high:.2f}]; largest log-prob difference {diff:.1e}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"seconds": {str(k): v for k, v in seconds.items()}, "ratio": ratio,
                                          "ratio_95": [low, high], "ranges": ranges, "chunks": chunks,
                                          "max_logprob_diff": diff}, indent=2))


if __name__ == "__main__":
    main()
