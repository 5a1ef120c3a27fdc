"""The LM head's strided input on CPU (cpu.contiguous_lm_head): `logits_to_keep` hands the head the last
position of each row, a slice torch's CPU linear cannot view as 2-D; in bf16 it then expands the weight once
per row when the weight needs no gradient (a LoRA run's frozen base, a reference model). First the head alone
at the embedded model's and the Qwen2.5-Coder models' shapes (bf16, a frozen weight, strided against contiguous,
with the memory the strided call took), then greedy sampling of --model in bf16, frozen, with and without the
contiguous copy (rows-first layers in both, as lanpo.py samples on CPU). Runs alternate; medians.

    python bench/lm_head_input.py                        # ~3 minutes on 2 cores
    python bench/lm_head_input.py --rounds 1 --heads smollm2 --prompts 8   # smoke run
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402

import cpu  # noqa: E402
import models  # noqa: E402
import prompts  # noqa: E402
from rollout import generate_completions  # noqa: E402

HEADS = {"smollm2": (49152, 576), "qwen2.5-coder-0.5b": (151936, 896), "qwen2.5-coder-1.5b": (151936, 1536)}


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux: kB


def head_ms(vocab: int, hidden: int, rows: int, rounds: int) -> dict[str, float]:
    """ms per call of the head on the last position of `rows` rows of 32 positions, strided and contiguous,
    and how much the process's peak memory rose over the strided calls (the expanded weight)."""
    weight = torch.randn(vocab, hidden, dtype=torch.bfloat16)  # needs no gradient, as a frozen head's
    x = torch.randn(rows, 32, hidden, dtype=torch.bfloat16)[:, -1:]
    times = {"strided": [], "contiguous": []}
    before = peak_gb()
    for _ in range(rounds):
        for name, inp in (("strided", x), ("contiguous", x.contiguous())):
            t0 = time.perf_counter()
            torch.nn.functional.linear(inp, weight)
            times[name].append((time.perf_counter() - t0) * 1000)
    return {"rows": rows, **{f"{k}_ms": statistics.median(v) for k, v in times.items()},
            "peak_rise_gb": peak_gb() - before}


def main() -> None:
    ap = common.parser(__doc__, "runs/bench/lm_head_input.json")
    ap.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    ap.add_argument("--rows", type=int, default=8, help="rows of each head call")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32, help="distinct prompts of the sampling call")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)

    heads = {}
    print(f"LM head in bf16, {args.rows} rows: strided ms, contiguous ms, ratio, peak memory rise (strided calls)")
    for name in args.heads:
        r = heads[name] = head_ms(*HEADS[name], args.rows, args.rounds)
        ratio = r["strided_ms"] / r["contiguous_ms"]
        print(f"  {name:20s} {r['strided_ms']:9.1f} {r['contiguous_ms']:8.1f} {ratio:7.1f}x  "
              f"+{r['peak_rise_gb']:.2f} GB", flush=True)

    tokenizer = models.load_tokenizer(args.model)
    plain = models.load_policy(args.model, torch.bfloat16).eval().requires_grad_(False)
    fixed = models.load_policy(args.model, torch.bfloat16).eval().requires_grad_(False)
    cpu.rows_first_linears(plain)  # what cpu.speed_up did before the head's copy
    cpu.speed_up(fixed)
    texts = [prompts.render_prompt(tokenizer, prompts.problem_request(f"What is {a} + {a + 3}?"), True)
             for a in range(args.prompts)]
    eos = models.eos_token_ids(plain, tokenizer)
    seconds, outs = {"strided": [], "contiguous": []}, {}
    for _ in range(args.rounds):
        for name, model in (("strided", plain), ("contiguous", fixed)):
            t0 = time.perf_counter()
            outs[name] = generate_completions(model, tokenizer, texts, eos_ids=eos, max_new_tokens=args.max_new_tokens,
                                              greedy=True)
            seconds[name].append(time.perf_counter() - t0)
    same = sum(a.text == b.text for a, b in zip(outs["strided"], outs["contiguous"])) / len(texts)
    sampling = {f"{k}_s": statistics.median(v) for k, v in seconds.items()}
    print(f"greedy sampling, {args.model}, bf16, {args.prompts} prompts x {args.max_new_tokens} tokens: strided head "
          f"{sampling['strided_s']:.2f} s, contiguous {sampling['contiguous_s']:.2f} s "
          f"({sampling['strided_s'] / sampling['contiguous_s']:.2f}x); same completions: {same:.2f}")
    common.save_json({"heads": heads, "sampling": {**sampling, "same_completions": same}, "args": vars(args)}, args.out)


if __name__ == "__main__":
    main()
