"""Learning on CPU: training arms with the same budget on the embedded SmolLM2-135M and the built-in data
(the default run's settings plus --flags), held-out greedy accuracy (no feedback) vs step for each, the
base model's accuracy on the same held-out problems, wall time; a PNG and a table.

    python bench/learning.py                      # GRPO vs LANPO, 6 steps each, eval every 2 (~15 min, 2 cores)
    python bench/learning.py --steps 10           # the README numbers (~25 min)
    python bench/learning.py --steps 10 --synthetic-size 16 --arms grpo lanpo lanpo+distill lanpo+self-distill \
        --out-dir runs/bench/feedback-grad        # feedback through the gradient (~45 min)
    python bench/learning.py --steps 2 --eval-every 1   # smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import data  # noqa: E402
import evaluate  # noqa: E402
import lanpo  # noqa: E402
import models  # noqa: E402
import plot  # noqa: E402


def base_accuracy(cfg: lanpo.Config) -> float:
    """Greedy accuracy of the untrained model on the held-out problems the training runs evaluate on."""
    rows = data.load_problems(cfg.dataset, cfg.eval_split, size=cfg.eval_size, seed=cfg.seed,
                              levels=lanpo.parse_levels(cfg.levels), train_size=cfg.synthetic_size)[0]
    tokenizer = models.load_tokenizer(cfg.model)
    model = models.load_policy(cfg.model, torch.float32)
    settings = evaluate.EvalSettings(samples=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens,
                                     one_shot=cfg.one_shot, gen_batch=cfg.gen_batch)
    _, summary = evaluate.evaluate_rows(model, tokenizer, rows, "zero-shot", settings,
                                        models.eos_token_ids(model, tokenizer))
    return summary["avg@1"]


ARMS = {  # name -> the flags that make it (on top of the common ones)
    "grpo": ["--feedback", "none"],
    "lanpo": ["--feedback", "both"],
    "lanpo+distill": ["--feedback", "both", "--feedback-grad", "distill"],
    "lanpo+self-distill": ["--feedback", "both"],  # + --self-distill-coef from this script's flag
    "lanpo+feedback-model": ["--feedback", "both", "--feedback-model-coef", "0.1"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--synthetic-size", type=int, default=lanpo.Config.synthetic_size,
                    help="training problems; fewer make problems recur (and feedback appear) sooner")
    ap.add_argument("--lr", type=float, default=lanpo.Config.lr,
                    help="learning rate of every arm; the default 2e-6 barely moves the model in 10 steps")
    ap.add_argument("--self-distill-coef", type=float, default=1.0,
                    help="coefficient of the lanpo+self-distill arm (at lr 2e-5, 1 collapses the 135M model)")
    ap.add_argument("--arms", nargs="+", default=["grpo", "lanpo"], choices=list(ARMS))
    ap.add_argument("--out-dir", default="runs/bench/learning")
    args = ap.parse_args()
    out = Path(args.out_dir)
    if out.exists():
        raise SystemExit(f"{out} exists (an earlier benchmark): choose another --out-dir or move it away")
    common = ["--steps", str(args.steps), "--eval-every", str(args.eval_every), "--report-to", "none",
              "--synthetic-size", str(args.synthetic_size), "--lr", str(args.lr)]
    cfg = lanpo.parse_config(common)
    result = {"base_accuracy": base_accuracy(cfg), "runs": {}}
    for name in args.arms:
        t0 = time.perf_counter()
        flags = ARMS[name]
        if name == "lanpo+self-distill":
            flags = flags + ["--self-distill-coef", str(args.self_distill_coef)]
        done = subprocess.run([sys.executable, str(ROOT / "lanpo.py"), *flags, "--out-dir", str(out / name),
                               *common], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"arm {name} failed:\n{done.stderr[-3000:]}")
        records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        result["runs"][name] = {"wall_s": time.perf_counter() - t0,
                                "eval": {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r},
                                "train_reward": [r["reward_mean"] for r in records],
                                "scratch_accuracy": [r.get("scratch/accuracy") for r in records]}
    png = plot.plot({name: [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
                     for name in args.arms}, out / "learning.png")
    steps = sorted(result["runs"][args.arms[0]]["eval"])
    print(f"held-out greedy accuracy (base model: {result['base_accuracy']:.3f})")
    print("| step | " + " | ".join(str(s) for s in steps) + " | train reward | from-scratch acc | wall |")
    print("|---|" + "---|" * (len(steps) + 3))
    for name, r in result["runs"].items():
        scratch = [a for a in r["scratch_accuracy"] if a is not None]
        print(f"| {name} | " + " | ".join(f"{r['eval'][s]:.3f}" for s in steps)
              + f" | {sum(r['train_reward']) / len(r['train_reward']):.3f} | {sum(scratch) / len(scratch):.3f}"
              + f" | {r['wall_s'] / 60:.1f} min |")
    print(f"curves: {png}")
    (out / "learning.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
