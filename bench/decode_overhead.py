"""What a decoding step costs under plain weights (bf16 on a GPU, fp32 on a CPU), bf16 autocast, LoRA
adapters (peft, all linear layers, fp32 adapters as peft keeps them), and both. The LoRA
runs of bench/gpu_engines.py (--dtype auto: bf16 autocast) sampled 4x slower than the full-weight
--dtype bf16 run on an H200; this separates adapters from autocast.

    python bench/decode_overhead.py                          # CPU: 28 layers of width 64
    python bench/decode_overhead.py --device cuda --hidden 3584 --intermediate 18944 --heads 28 --kv-heads 4
                                                             # Qwen2.5-7B's layers (small vocabulary)
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM


def ms_per_step(model, prompts: torch.Tensor, steps: int, autocast: bool, device: str) -> float:
    cast = torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    kwargs = dict(do_sample=True, top_k=0, pad_token_id=0, eos_token_id=None)
    with torch.no_grad(), cast:
        model.generate(prompts, max_new_tokens=4, **kwargs)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(prompts, max_new_tokens=steps, min_new_tokens=steps, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--passes", type=int, default=3, help="rounds over the set-ups, alternating their order")
    args = ap.parse_args()
    config = AutoConfig.for_model("qwen2", vocab_size=512, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                  intermediate_size=args.intermediate, num_attention_heads=args.heads,
                                  num_key_value_heads=args.kv_heads)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # a LoRA run's frozen base on a GPU
    torch.manual_seed(0)
    prompts = torch.randint(1, 512, (args.batch, 50), device=args.device)
    with torch.device(args.device):  # initialised where it runs (7B-wide layers take long on a CPU)
        base = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        lora = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=dtype),
                              LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear"))
    lora.eval()
    rows = {"plain": (base, False), "autocast bf16": (base, True), "LoRA": (lora, False),
            "LoRA + autocast bf16": (lora, True)}
    # every set-up measured in --passes rounds, the order reversed each round, best round kept: on the H200
    # the set-up measured first in a fresh process was slowest (clocks, lazy initialisation)
    best = {label: float("inf") for label in rows}
    for round_ in range(args.passes):
        for label in (list(rows) if round_ % 2 == 0 else list(reversed(rows))):
            model, autocast = rows[label]
            best[label] = min(best[label], ms_per_step(model, prompts, args.steps, autocast, args.device))
    shape = f"{args.layers} layers, width {args.hidden}, batch {args.batch}, {args.device}"
    print(f"| {shape} | ms a decoding step (best of {args.passes}) | vs plain |")
    print("|---|---:|---:|")
    for label, ms in best.items():
        print(f"| {label} | {ms:.1f} | {ms / best['plain']:.2f}× |")


if __name__ == "__main__":
    main()
