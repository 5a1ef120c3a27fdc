"""What a decoding step costs where decoding is bound by per-operation overhead (small batches, or any
model on a CPU): plain weights, bf16 autocast, LoRA adapters (peft, all linear layers), and both. The LoRA
runs of bench/gpu_engines.py (--dtype auto: bf16 autocast) sampled 4x slower than the full-weight
--dtype bf16 run on an H200; this separates the two causes on a model whose arithmetic is negligible.

    python bench/decode_overhead.py                          # CPU: 28 layers of width 64
    python bench/decode_overhead.py --device cuda --hidden 3584 --intermediate 18944   # 7B layer shapes
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
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--lora-rank", type=int, default=16)
    args = ap.parse_args()
    config = AutoConfig.for_model("qwen2", vocab_size=512, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                  intermediate_size=args.intermediate, num_attention_heads=4, num_key_value_heads=2)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # a LoRA run's frozen base on a GPU
    torch.manual_seed(0)
    prompts = torch.randint(1, 512, (args.batch, 50), device=args.device)
    base = AutoModelForCausalLM.from_config(config, dtype=dtype).to(args.device).eval()
    lora = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=dtype).to(args.device),
                          LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear"))
    lora.eval()
    rows = {"plain": (base, False), "autocast bf16": (base, True), "LoRA": (lora, False),
            "LoRA + autocast bf16": (lora, True)}
    plain = None
    shape = f"{args.layers} layers, width {args.hidden}, batch {args.batch}, {args.device}"
    print(f"| {shape} | ms a decoding step | vs plain |")
    print("|---|---:|---:|")
    for label, (model, autocast) in rows.items():
        ms = ms_per_step(model, prompts, args.steps, autocast, args.device)
        plain = plain or ms
        print(f"| {label} | {ms:.1f} | {ms / plain:.2f}× |")


if __name__ == "__main__":
    main()
