"""Step time and peak memory: lanpo.py (plain GRPO) against TRL's GRPOTrainer on an identical configuration:
the embedded SmolLM2-135M on CPU, the same synthetic:arith problems in the same order (lanpo's step order
written out for TRL with its shuffling off; the ids TRL graded are checked) and one-shot chat prompt, the same
reward (math_grader.grade), B problems x G samples, max_new_tokens, one policy epoch, constant LR, beta = 0,
the `grpo` loss, group-std advantages, no gradient checkpointing, fp32, the same malloc settings
(`cpu.speed_up`). Runs alternate (ours, TRL, ours, TRL, ...) in fresh processes; the first
step of every run is warm-up and not counted. Prints every timed step of each side, the medians with
min-max, the ratio of medians with a 95 % bootstrap interval (steps resampled), lanpo's time split
(generate / grade / log-probs / update) and each side's peak memory.

    pip install trl            # benchmark-only dependency (1.16.0 measured)
    python bench/vs_trl.py                     # 3 rounds x 6 steps, B=4, G=4, 32 new tokens
    python bench/vs_trl.py --rounds 1 --steps 2  # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRL_RUN = r'''
import json, sys, time
sys.path.insert(0, {root!r})
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
import cpu, lanpo, math_grader, prompts
cpu.speed_up()  # the malloc settings lanpo.py makes on CPU: compare the trainers, not allocators

args = json.loads(sys.argv[1])
rows = [json.loads(line) for line in open(args["data"])]
shot = list(prompts.ONE_SHOT)
dataset = Dataset.from_list([{{"prompt": shot + [{{"role": "user", "content": prompts.problem_request(r["problem"])}}],
                              "answer": r["answer"], "id": r["id"]}} for r in rows])

seen_ids = []  # problem ids of each step's groups, in order (one entry per rollout)
def reward(completions, answer, id, completion_ids, **kwargs):
    seen_ids.append(list(id))
    # cut at the limit without an EOS, as lanpo's sampler flags it: the grader reads no answer the cut shortened
    cut = [len(ids) >= args["max_new_tokens"] and ids[-1] not in trainer.eos_token_ids for ids in completion_ids]
    return [math_grader.grade(c[0]["content"], a, truncated=t) for c, a, t in zip(completions, answer, cut)]

times, records = [], []
class Recorder(TrainerCallback):
    def on_step_begin(self, *a, **k): self.t = time.perf_counter()
    def on_step_end(self, *a, **k): times.append(time.perf_counter() - self.t)
    def on_log(self, args, state, control, logs=None, **k):
        if logs and "reward" in logs:  # lanpo's metrics.jsonl names, so plot.py draws both
            records.append({{"step": state.global_step, "reward_mean": logs["reward"],
                            "response_len_mean": logs["completions/mean_length"]}})

n = args["batch_problems"] * args["group_size"]
config = GRPOConfig(output_dir=args["out"], per_device_train_batch_size=n, num_generations=args["group_size"],
                    gradient_accumulation_steps=1, max_completion_length=args["max_new_tokens"],
                    max_steps=args["steps"], learning_rate=args["lr"], lr_scheduler_type="constant", beta=0.0,
                    loss_type="grpo", num_iterations=1,
                    temperature=1.0, top_p=1.0, top_k=0, epsilon=0.2, scale_rewards="group", use_cpu=True,
                    gradient_checkpointing=False, bf16=False, report_to="none", save_strategy="no",
                    logging_steps=1, seed=args["seed"], disable_dropout=True,
                    shuffle_dataset=args["shuffle"])
math_grader.warm_up()
trainer = GRPOTrainer(model=args["model"], reward_funcs=[reward], args=config, train_dataset=dataset)
trainer.add_callback(Recorder())
trainer.train()
json.dump({{"step_times": times, "records": records, "seen_ids": seen_ids}}, open(args["result"], "w"))
'''


SPLIT = ("time_generate", "time_grade", "time_logprob", "time_update")  # lanpo's metrics of each step


def lanpo_order(rows: list[dict], steps: int, batch_problems: int, seed: int) -> list[dict]:
    """The problems lanpo trains on, step after step (lanpo.problems_for_step): written out as TRL's data set
    with its shuffling off, TRL's step k then holds the same B problems as lanpo's."""
    import lanpo

    return [row for step in range(steps) for row in lanpo.problems_for_step(rows, step, batch_problems, seed)]


def check_same_problems(result: dict, order: list[dict], group_size: int, what: str) -> None:
    """Stop unless the problems TRL graded (its reward function saw their ids) are `order`."""
    graded = [i for call in result["seen_ids"] for i in call[::group_size]]
    expected = [r["id"] for r in order]
    if graded != expected:
        raise SystemExit(f"{what}: TRL graded problems {graded[:8]}... but lanpo's order is {expected[:8]}...: "
                         "the runs are not on the same problems")


def run_child(cmd: list[str], env: dict) -> float:
    """Run a command to completion; return its peak resident memory in MB."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{cmd[:3]} failed:\n{proc.stderr.read()[-3000:]}")
    return usage.ru_maxrss / 1024  # Linux reports KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating (ours, TRL) pairs")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is warm-up)")
    ap.add_argument("--batch-problems", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default="runs/bench/vs_trl.json")
    args = ap.parse_args()

    import data
    import models
    import stats

    model_dir = str(models.embedded_model_dir())
    work = Path(tempfile.mkdtemp(prefix="vs_trl_"))
    rows = data.synthetic_arith("train", 80, seed=0, levels=[1, 2, 3])
    (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    order = lanpo_order(rows, args.steps, args.batch_problems, seed=0)  # lanpo's steps, for TRL in this order
    (work / "trl_data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in order))
    env = dict(os.environ, WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    ours_times, trl_times, ours_rss, trl_rss, ours_split = [], [], [], [], {}
    n = args.batch_problems * args.group_size
    for r in range(args.rounds):
        out = work / f"ours-{r}"
        ours_rss.append(run_child([sys.executable, str(ROOT / "lanpo.py"), "--model", model_dir,
                                   "--dataset", str(work / "data.jsonl"),
                   "--feedback", "none", "--steps", str(args.steps), "--batch-problems", str(args.batch_problems),
                   "--group-size", str(args.group_size), "--micro-batch", str(n), "--gen-batch", str(n),
                   "--max-new-tokens", str(args.max_new_tokens), "--eval-every", "0", "--lr", "2e-6",
                   "--report-to", "none", "--no-final-checkpoint", "--out-dir", str(out)], env))
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
        ours_times += [r["time_step"] for r in records]
        for key in SPLIT:
            ours_split.setdefault(key, []).extend(r[key] for r in records)
        spec = {"root": str(ROOT), "data": str(work / "trl_data.jsonl"), "model": model_dir, "steps": args.steps,
                "batch_problems": args.batch_problems, "group_size": args.group_size,
                "max_new_tokens": args.max_new_tokens, "seed": 0, "lr": 2e-6, "shuffle": False,
                "out": str(work / f"trl-{r}"),
                "result": str(work / f"trl-{r}.json")}
        script = work / "trl_run.py"
        script.write_text(TRL_RUN.format(root=str(ROOT)))
        trl_rss.append(run_child([sys.executable, str(script), json.dumps(spec)], env))
        trl_result = json.loads(Path(spec["result"]).read_text())
        check_same_problems(trl_result, order, args.group_size, f"round {r}")
        trl_times += trl_result["step_times"][1:]
    low, high = stats.median_ratio_interval(ours_times, trl_times)
    result = {
        "config": vars(args), "ours_step_s": ours_times, "trl_step_s": trl_times, "ours_split_s": ours_split,
        "ours_median_s": float(np.median(ours_times)), "trl_median_s": float(np.median(trl_times)),
        "ratio": float(np.median(ours_times) / np.median(trl_times)), "ratio_95": [low, high],
        "ours_peak_rss_mb": max(ours_rss), "trl_peak_rss_mb": max(trl_rss),
    }
    print(f"B={args.batch_problems} G={args.group_size} max_new_tokens={args.max_new_tokens}, "
          f"{args.rounds} rounds x {args.steps - 1} timed steps")
    print("every timed step (s), in run order:")
    print("  lanpo: " + " ".join(f"{t:.1f}" for t in ours_times))
    print("  TRL:   " + " ".join(f"{t:.1f}" for t in trl_times))
    print("| | median step (s) | min-max (s) | peak RSS (MB) |\n|---|---|---|---|")
    for name, times, rss in (("lanpo", ours_times, result["ours_peak_rss_mb"]),
                             ("TRL GRPOTrainer", trl_times, result["trl_peak_rss_mb"])):
        print(f"| {name} | {np.median(times):.2f} | {min(times):.1f}-{max(times):.1f} | {rss:.0f} |")
    print(f"ratio ours/TRL (medians): {result['ratio']:.2f}, 95% bootstrap interval {low:.2f}-{high:.2f}")
    split = {k: float(np.median(v)) for k, v in ours_split.items()}
    print("lanpo step split (median s): " + ", ".join(f"{k[5:]} {v:.2f}" for k, v in split.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    shutil.rmtree(work)  # both sides' saved models: 1.6 GB


if __name__ == "__main__":
    main()
