"""Rows-first linear layers on CPU (cpu.RowsFirstLinear): x·Wᵀ against W·xᵀ for the embedded model's layer
shapes at decoding batch sizes, then whole decoding steps of the embedded model with and without them, and
whether greedy decoding picks the same tokens. Runs alternate (plain, rows-first, plain, ...); medians.

    python bench/cpu_matmul.py                      # ~8 minutes on 2 cores
    python bench/cpu_matmul.py --rounds 1 --batches 1 4    # smoke run
"""

from __future__ import annotations

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

SHAPES = {"lm_head": (49152, 576), "gate/up": (1536, 576), "down": (576, 1536), "q/o": (576, 576), "k/v": (192, 576)}


def layer_ms(out_features: int, in_features: int, rows: int, rounds: int) -> tuple[float, float]:
    """ms per call of one layer shape, cycling through enough copies of the weights (256 MB) that each call
    reads its weights from memory, as a decoding step does, not from a warm cache."""
    copies = max(1, int(2 ** 28 // (4 * out_features * in_features)))
    plain = [torch.nn.Linear(in_features, out_features, bias=False) for _ in range(copies)]
    fast = [torch.nn.Linear(in_features, out_features, bias=False) for _ in range(copies)]
    for a, b in zip(plain, fast):
        b.weight = a.weight
    cpu.rows_first_linears(torch.nn.Sequential(*fast))
    x = torch.randn(rows, 1, in_features)
    repeat = max(1, 64 // copies)
    times = {0: [], 1: []}
    with torch.no_grad():
        for _ in range(rounds):
            for i, layers in enumerate((plain, fast)):
                for layer in layers:
                    layer(x)
                t0 = time.perf_counter()
                for _ in range(repeat):
                    for layer in layers:
                        layer(x)
                times[i].append(1000 * (time.perf_counter() - t0) / (repeat * copies))
    return statistics.median(times[0]), statistics.median(times[1])


def decode_ms(model, tokenizer, texts: list[str], steps: int) -> tuple[float, list[list[int]]]:
    """ms per decoding step (a steps+1-token call less a 1-token call: the prefill cancels) and the tokens."""
    t0 = time.perf_counter()
    generate_completions(model, tokenizer, texts, eos_ids=[], max_new_tokens=1, greedy=True)
    t1 = time.perf_counter()
    outs = generate_completions(model, tokenizer, texts, eos_ids=[], max_new_tokens=steps + 1, greedy=True)
    t2 = time.perf_counter()
    return 1000 * ((t2 - t1) - (t1 - t0)) / steps, [o.completion_ids.tolist() for o in outs]


def main() -> None:
    ap = common.parser(__doc__, "runs/bench/cpu_matmul.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64, 256])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64])
    ap.add_argument("--steps", type=int, default=24, help="decoding steps timed per call")
    args = ap.parse_args()
    cpu.speed_up()  # as lanpo.py does on CPU
    torch.manual_seed(0)
    result = {"layers_ms": {}, "decode_ms_per_step": {}, "same_greedy_tokens": {}}
    print("layer (out x in), rows: x·Wᵀ ms, W·xᵀ ms, speed-up")
    for name, (n, k) in SHAPES.items():
        for rows in args.rows:
            a, b = layer_ms(n, k, rows, args.rounds)
            result["layers_ms"][f"{name} {rows}"] = [a, b]
            print(f"  {name:8s} {n}x{k} rows {rows:3d}: {a:8.3f} {b:8.3f}  {a / b:5.2f}x", flush=True)

    tokenizer = models.load_tokenizer(args.model)
    plain = models.load_policy(args.model, torch.float32).eval()
    fast = models.load_policy(args.model, torch.float32).eval()
    cpu.rows_first_linears(fast)
    questions = [f"A shop sells {3 + i} boxes of {12 + 2 * i} pencils and {7 + i} single pencils. How many pencils "
                 f"does it sell in all?" for i in range(max(args.batches))]
    print(f"decoding, {args.steps} greedy steps per call: batch, plain ms/step, rows-first ms/step, speed-up")
    for batch in args.batches:
        texts = [prompts.render_prompt(tokenizer, prompts.problem_request(q), True) for q in questions[:batch]]
        times, tokens = {0: [], 1: []}, {}
        for _ in range(args.rounds):
            for i, model in enumerate((plain, fast)):
                ms, tokens[i] = decode_ms(model, tokenizer, texts, args.steps)
                times[i].append(ms)
        a, b = statistics.median(times[0]), statistics.median(times[1])
        result["decode_ms_per_step"][str(batch)] = [a, b]
        result["same_greedy_tokens"][str(batch)] = tokens[0] == tokens[1]
        print(f"  batch {batch:3d}: {a:7.1f} {b:7.1f}  {a / b:5.2f}x  same greedy tokens: {tokens[0] == tokens[1]}",
              flush=True)
    common.save_json(result, args.out)


if __name__ == "__main__":
    main()
