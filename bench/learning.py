"""Learning on CPU: GRPO (`--feedback none`) and LANPO (`--feedback both`) with the same budget on the
embedded SmolLM2-135M and the built-in data (the default run's settings), held-out greedy accuracy vs
step for both, the base model's accuracy on the same held-out problems, wall time; a PNG and a table.

    python bench/learning.py                      # 6 steps each, eval every 2 steps (~15 min on 2 cores)
    python bench/learning.py --steps 10           # the README numbers (~25 min)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--out-dir", default="runs/bench/learning")
    args = ap.parse_args()
    out = Path(args.out_dir)
    if out.exists():
        raise SystemExit(f"{out} exists (an earlier benchmark): choose another --out-dir or move it away")
    common = ["--steps", str(args.steps), "--eval-every", str(args.eval_every), "--report-to", "none"]
    cfg = lanpo.parse_config(common)
    result = {"base_accuracy": base_accuracy(cfg), "runs": {}}
    for name, feedback in (("grpo", "none"), ("lanpo", "both")):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "lanpo.py"), "--feedback", feedback, "--out-dir",
                        str(out / name), *common], check=True, capture_output=True)
        records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        result["runs"][name] = {"wall_s": time.perf_counter() - t0,
                                "eval": {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r},
                                "train_reward": [r["reward_mean"] for r in records]}
    png = plot.plot({name: [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
                     for name in ("grpo", "lanpo")}, out / "learning.png")
    steps = sorted(result["runs"]["grpo"]["eval"])
    print(f"held-out greedy accuracy (base model: {result['base_accuracy']:.3f})")
    print("| step | " + " | ".join(str(s) for s in steps) + " | wall |")
    print("|---|" + "---|" * (len(steps) + 1))
    for name, r in result["runs"].items():
        print(f"| {name} | " + " | ".join(f"{r['eval'][s]:.3f}" for s in steps) + f" | {r['wall_s'] / 60:.1f} min |")
    print(f"curves: {png}")
    (out / "learning.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
