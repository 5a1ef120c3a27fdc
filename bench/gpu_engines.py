"""The shapes users train, on one GPU: Qwen2.5-7B's architecture (configs/qwen2.5-7b-shapes.json, random
weights, no hub) through lanpo.py for two steps at realistic lengths (B = 2 problems x G = 8 rollouts of
1024 new tokens, --feedback both) under each set-up:
  lora      LoRA r16 on one GPU (frozen bf16 base)
  full-bf16 all weights trained in bf16 on one GPU (--dtype bf16: 8 bytes a parameter)
  zero3     DeepSpeed ZeRO-3 in one process (configs/zero3.yaml), bf16 weights
Writes, per set-up, the peak memory and each step's time (or the error that stopped it) to JSON, after
each set-up, so a time-out keeps what finished. Budget: about 6 minutes on one H200.

    python bench/gpu_engines.py                      # on a GPU machine: runs/bench/gpu_engines.json
    python bench/gpu_engines.py --shapes tiny --cpu  # the CPU twin (tests/test_gpu_check.py): same set-ups
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import build_tokenizer  # noqa: E402  the tests' hub-free tokenizer

TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # vocab > the tokenizer's 400, as Qwen's padded one
SETUPS = {
    "lora": ["--lora-rank", "16", "--lr", "1e-5"],
    "full-bf16": ["--dtype", "bf16", "--lr", "1e-6"],
    "zero3": ["--dtype", "bf16", "--lr", "1e-6"],
}


def build_model(out: Path, shapes: str, device: str) -> Path:
    """Random weights with the chosen shapes, saved in bf16 with the hub-free tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer()
    spec = json.loads((ROOT / "configs" / "qwen2.5-7b-shapes.json").read_text())
    if shapes == "tiny":
        spec.update(TINY)
    model_type = spec.pop("model_type")
    spec.pop("architectures")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = AutoConfig.for_model(model_type, **spec, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = [eos, tokenizer.pad_token_id]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run_setup(name: str, model_dir: Path, out_dir: Path, cpu: bool, timeout: int) -> dict:
    common = ["--model", str(model_dir), "--out-dir", str(out_dir), "--steps", "2", "--batch-problems", "2",
              "--group-size", "8", "--micro-batch", "4", "--gen-batch", "16", "--max-new-tokens",
              "32" if cpu else "1024", "--feedback", "both", "--relevance-threshold", "0", "--eval-every", "0",
              "--gradient-checkpointing", "--no-final-checkpoint", "--report-to", "none", *SETUPS[name]]
    # the CPU twin goes through tests/engines.py, which lets accelerate run DeepSpeed on a CPU
    entry = str(ROOT / ("tests/engines.py" if cpu else "lanpo.py"))
    env = dict(os.environ, LANPO_TEST_ENGINE="zero3" if name == "zero3" else "single")
    if name == "zero3":
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "configs" / "zero3.yaml"), "--num_processes", "1", "--mixed_precision", "no",
                   entry, *common]
    else:
        command = [sys.executable, entry, *common]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout} s"}
    result = {"ok": done.returncode == 0, "wall_s": round(time.perf_counter() - t0, 1)}
    if done.returncode:
        result["error"] = done.stderr[-2000:]
        return result
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    result.update(step_s=[round(r["time_step"], 2) for r in records],
                  generate_s=[round(r["time_generate"], 2) for r in records],
                  update_s=[round(r["time_update"], 2) for r in records],
                  peak_memory_gb=round(max(r["memory_peak_gb"] for r in records), 2),
                  tokens_per_s=[round(r["tokens_per_s"], 1) for r in records])
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", choices=["qwen2.5-7b", "tiny"], default="qwen2.5-7b")
    ap.add_argument("--cpu", action="store_true", help="the CPU twin: no GPU needed")
    ap.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    ap.add_argument("--work-dir", default="runs/bench/gpu_engines", help="model and runs (removed at the end)")
    ap.add_argument("--out", default="runs/bench/gpu_engines.json")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per set-up")
    args = ap.parse_args(argv)
    work, out = Path(args.work_dir), Path(args.out)
    if work.exists():
        raise SystemExit(f"{work} exists: remove it or pass another --work-dir")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model_dir = build_model(work / "model", args.shapes, "cpu" if args.cpu else "cuda")
    report = {"shapes": args.shapes, "build_s": round(time.perf_counter() - t0, 1), "setups": {}}
    for name in args.setups:
        report["setups"][name] = run_setup(name, model_dir, work / name, args.cpu, args.timeout)
        shutil.rmtree(work / name, ignore_errors=True)  # final/ of a 7B model is 15 GB
        out.write_text(json.dumps(report, indent=2))
        print(name, json.dumps(report["setups"][name])[:300], flush=True)
    shutil.rmtree(work)
    return report


if __name__ == "__main__":
    main()
