"""The shapes users train, on one GPU: Qwen2.5-7B's architecture (configs/qwen2.5-7b-shapes.json, random
weights, no hub) through lanpo.py for two steps at realistic lengths (B = 2 problems x G = 8 rollouts of
1024 new tokens, --feedback both) under each set-up:
  lora      LoRA r16 on one GPU (frozen bf16 base)
  full-bf16 all weights trained in bf16 on one GPU (--dtype bf16: 8 bytes a parameter)
  full-bf16-compiled  the same with --compile-decoding (static KV cache, CUDA graphs of the decoding step)
  zero3     DeepSpeed ZeRO-3 in one process (configs/zero3.yaml), bf16 weights, on 14 of the 28 layers:
            one process keeps every byte a single GPU would and DeepSpeed's fp32 copies (about 22 bytes a
            parameter, ~165 GB at 7.6 B), more than one H200; 4.35 B parameters fit and run the same code
Writes, per set-up, the peak memory and each step's time (or the error that stopped it) to JSON, after
each set-up, so a time-out keeps what finished (also the steps a timed-out set-up finished). Budget:
about 10 minutes on one H200, one device call (2026-12-04, at a 160 s limit: full bf16 took 158 s,
LoRA reached step 1 only; `--setups lora --timeout 400` gives it its second step).

    python bench/gpu_engines.py                      # on a GPU machine: runs/bench/gpu_engines.json
    python bench/gpu_engines.py --shapes tiny --cpu  # the CPU twin (tests/test_gpu_check.py): same set-ups
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
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
    "full-bf16-compiled": ["--dtype", "bf16", "--lr", "1e-6", "--compile-decoding"],
    "zero3": ["--dtype", "bf16", "--lr", "1e-6"],
}
HALF_DEPTH = {"zero3"}  # set-ups that run on the model with half the layers (not on the tiny shapes)


def random_model(shapes: str, device: str, half_depth: bool = False):
    """(model, tokenizer): random bf16 weights with the chosen shapes (half the layers if asked), built on
    `device`, and the hub-free tokenizer (left padding, as models.load_tokenizer sets)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"
    spec = json.loads((ROOT / "configs" / "qwen2.5-7b-shapes.json").read_text())
    if shapes == "tiny":
        spec.update(TINY)
    if half_depth:
        spec["num_hidden_layers"] //= 2
    model_type = spec.pop("model_type")
    spec.pop("architectures")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = AutoConfig.for_model(model_type, **spec, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = [eos, tokenizer.pad_token_id]
    return model, tokenizer


def build_model(out: Path, shapes: str, device: str, half_depth: bool = False) -> Path:
    """`random_model` saved as a model directory."""
    import torch

    model, tokenizer = random_model(shapes, device, half_depth)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the set-ups run in child processes: leave them the memory
    return out


def kill_run(out_dir: Path) -> None:
    """Kill every process of one set-up: the launcher and the workers it started in sessions of their own
    (killing only the launcher leaves a worker holding the GPU through the next set-up). Linux /proc."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(out_dir).encode() in cmdline.read_bytes():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # the process ended meanwhile


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
    log = out_dir.parent / f"{name}.stderr"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT)
        try:
            proc.wait(timeout=timeout)
            result = {"ok": proc.returncode == 0}
        except subprocess.TimeoutExpired:
            kill_run(out_dir)
            proc.wait()
            result = {"ok": False, "error": f"timed out after {timeout} s"}
    if proc.returncode and "error" not in result:
        result["error"] = log.read_text()[-2000:]
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    metrics = out_dir / "metrics.jsonl"  # the steps that finished, also before an error or a time-out
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if records:
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
    ap.add_argument("--timeout", type=int, default=200, help="seconds per set-up, start-up included")
    args = ap.parse_args(argv)
    work, out = Path(args.work_dir), Path(args.out)
    if work.exists():
        raise SystemExit(f"{work} exists: remove it or pass another --work-dir")
    out.parent.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.cpu else "cuda"
    report = {"shapes": args.shapes, "build_s": {}, "setups": {}}
    for name in args.setups:
        half = name in HALF_DEPTH and args.shapes != "tiny"
        model_dir = work / ("model-half-depth" if half else "model")
        if not model_dir.exists():
            t0 = time.perf_counter()
            build_model(model_dir, args.shapes, device, half_depth=half)
            report["build_s"][model_dir.name] = round(time.perf_counter() - t0, 1)
        report["setups"][name] = run_setup(name, model_dir, work / name, args.cpu, args.timeout)
        report["setups"][name]["layers"] = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
        shutil.rmtree(work / name, ignore_errors=True)  # final/ of a 7B model is 15 GB
        out.write_text(json.dumps(report, indent=2))
        print(name, json.dumps(report["setups"][name])[:300], flush=True)
    shutil.rmtree(work)
    return report


if __name__ == "__main__":
    main()
