"""Sampling against the hardware's limit. A decoding step of a few rows reads every weight once, so its least
time is the weights' bytes over the memory bandwidth; this bench measures both itself (a large copy on the
device, bytes read plus written) and times lanpo's own sampling path (`rollout.generate_completions`: GRPO
groups of 4 rows sharing a prompt, temperature 1) per decoding step, under each set-up:
  eager                HF generate with a DynamicCache (the default)
  compiled             --compile-decoding: static KV cache, decoding step compiled (CUDA graphs on GPU)
  lora                 LoRA r16 on every linear layer, sampled through the adapters (--no-lora-merged-sampling)
  lora-merged          the adapters merged into a copy of the base weights (--lora-merged-sampling, the default)
  lora-merged-compiled both
A step's time is (time of N new tokens - time of 1) / (N - 1): the prefill and the first token left out.
Passes alternate the set-ups' order; each ratio to `eager` (and lora-merged to lora) is of the medians over
passes, with a 95 % bootstrap interval. The fraction is the bandwidth limit's step time over the measured one.

    python bench/decode_overhead.py                                     # CPU: the embedded model, batch 4, 16
    python bench/decode_overhead.py --device cuda --shapes qwen2.5-7b --batch 16 64 --steps 64
                                                                        # one GPU: Qwen2.5-7B, random bf16 weights
    python bench/decode_overhead.py --shapes tiny --passes 2 --steps 8  # the CPU twin (tests/test_gpu_check.py)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402
import gpu_engines  # noqa: E402

import cpu  # noqa: E402
import models  # noqa: E402
import prompts  # noqa: E402
import rollout  # noqa: E402
import stats  # noqa: E402

SETUPS = ["eager", "compiled", "lora", "lora-merged", "lora-merged-compiled"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def weight_gb(model) -> float:
    """The bytes a decoding step must read: every weight but the input embedding (one row of it a token),
    which the LM head reads whole when the two are tied."""
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    return sum(q.numel() * q.element_size() for q in model.parameters()
               if q is not embedding or tied) / 1e9


def load(shapes: str, device: torch.device, lora: bool):
    """(model, tokenizer): the embedded model (fp32 on a CPU, as lanpo.py trains it there), or random bf16 weights
    of Qwen2.5-7B's shapes or the tiny ones (bench/gpu_engines.py)."""
    if shapes == "embedded":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model, tokenizer = models.load_policy(models.EMBEDDED, dtype), models.load_tokenizer(models.EMBEDDED)
    else:
        model, tokenizer = gpu_engines.random_model(shapes, str(device))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.to(device).eval()
    if device.type == "cpu":
        cpu.speed_up(model)  # as lanpo.py samples on a CPU
    return model, tokenizer


def group_prompts(tokenizer, rows: int) -> list[str]:
    """rows / 4 problems, each repeated for a group of 4 (prefill sharing as in training)."""
    problems = [prompts.problem_request(f"What is {7 * i + 3} + {11 * i + 5}, times {i + 2}?")
                for i in range(max(1, rows // 4))]
    return [prompts.render_prompt(tokenizer, p, True) for p in problems for _ in range(4)][:rows]


def step_ms(model, tokenizer, texts: list[str], steps: int, compiled: bool, merged: bool) -> float:
    """ms a decoding step: N new tokens against 1, through generate_completions (no EOS, every row runs N)."""
    times = []
    with models.merged_lora(model) if merged else contextlib.nullcontext():
        for n in (1, steps):
            sync(model.device)
            t0 = time.perf_counter()
            rollout.generate_completions(model, tokenizer, texts, eos_ids=[], max_new_tokens=n, batch_size=len(texts),
                                         compiled=compiled)
            sync(model.device)
            times.append(time.perf_counter() - t0)
    return 1000 * (times[1] - times[0]) / (steps - 1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shapes", choices=["embedded", "qwen2.5-7b", "tiny"], default="embedded",
                    help="the embedded model (SmolLM2-135M) or random bf16 weights of these shapes")
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 16], help="rows a generate call")
    ap.add_argument("--steps", type=int, default=32, help="new tokens a timed call")
    ap.add_argument("--passes", type=int, default=5, help="rounds over the set-ups, alternating their order")
    ap.add_argument("--setups", nargs="+", default=SETUPS, choices=SETUPS)
    ap.add_argument("--out", default="runs/bench/decode_overhead.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    bandwidth = common.copy_bandwidth_gb_s(str(device))
    plain, tokenizer = load(args.shapes, device, lora=False)
    adapted = load(args.shapes, device, lora=True)[0] if any(s.startswith("lora") for s in args.setups) else None
    gb = weight_gb(plain)
    limit_ms = 1000 * gb / bandwidth
    runs = {s: {"compiled": s.endswith("compiled"), "merged": "merged" in s,
                "model": adapted if s.startswith("lora") else plain} for s in args.setups}
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "shapes": args.shapes,
              "bandwidth_gb_s": bandwidth, "weight_gb": gb, "limit_ms": limit_ms, "steps": args.steps,
              "compile_s": {}, "ms": {s: {str(b): [] for b in args.batch} for s in args.setups}}
    # warm-up: every set-up once per batch size; the compiled ones compile here, and their cost is reported
    for s, r in runs.items():
        for b in args.batch:
            before = rollout.compiling_stats()
            step_ms(r["model"], tokenizer, group_prompts(tokenizer, b), min(args.steps, 4), r["compiled"], r["merged"])
            after = rollout.compiling_stats()
            result["compile_s"][f"{s}/{b}"] = after["compile_s"] - before["compile_s"]
    graphs = rollout.compiling_stats()["compiled_graphs"]
    for p in range(args.passes):
        for s in (args.setups if p % 2 == 0 else list(reversed(args.setups))):
            for b in args.batch:
                r = runs[s]
                result["ms"][s][str(b)].append(step_ms(r["model"], tokenizer, group_prompts(tokenizer, b), args.steps,
                                                  r["compiled"], r["merged"]))
    result["recompiled_in_passes"] = rollout.compiling_stats()["compiled_graphs"] - graphs
    print(f"{result['device']}, {args.shapes}: {gb:.2f} GB of weights read a step, {bandwidth:.1f} GB/s copy "
          f"bandwidth: limit {limit_ms:.2f} ms a step; {args.steps} new tokens, {args.passes} passes; "
          f"graphs compiled during the passes: {result['recompiled_in_passes']:.0f}")
    print("| set-up | rows | ms a step (median) | tokens/s | of the limit | vs eager [95 %] | compile s |")
    print("|---|---:|---:|---:|---:|---|---:|")
    result["summary"] = {}
    for s in args.setups:
        for b in args.batch:
            ms = statistics.median(result["ms"][s][str(b)])
            row = {"ms": ms, "tokens_per_s": b * 1000 / ms, "of_limit": limit_ms / ms}
            base = "lora" if s.startswith("lora-merged") and "lora" in args.setups else "eager"
            if base in args.setups and s != base:
                row["vs"] = base
                row["ratio"] = ms / statistics.median(result["ms"][base][str(b)])
                row["ratio_95"] = stats.median_ratio_interval(result["ms"][s][str(b)], result["ms"][base][str(b)])
            result["summary"][f"{s}/{b}"] = row
            ratio = f"{row['ratio']:.2f}x [{row['ratio_95'][0]:.2f}, {row['ratio_95'][1]:.2f}] vs {base}" \
                if "ratio" in row else "-"
            print(f"| {s} | {b} | {ms:.1f} | {row['tokens_per_s']:.0f} | {row['of_limit']:.0%} | {ratio} | "
                  f"{result['compile_s'][f'{s}/{b}']:.0f} |")
    common.save_json(result, args.out, 1)
    return result


if __name__ == "__main__":
    main()
