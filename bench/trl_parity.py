"""Learning parity with TRL: lanpo's GRPO (`--feedback none`) and TRL's GRPOTrainer on an identical
configuration, over several seeds, compared by their training-reward curves.

Identical per seed: the embedded SmolLM2-135M, fp32 on CPU; the same problems in the same order (lanpo's
own step order, written out for TRL with its shuffling off; the problem ids TRL graded are checked
against it); the one-shot chat prompt; the reward (math_grader.grade); B problems x G samples at
temperature 1, no top-k/top-p; max_new_tokens; constant LR; AdamW without weight decay; gradient-norm
clip 1; one policy epoch, clip 0.2, beta = 0; the `grpo` loss with group-std advantages. What differs is
each framework's own code, and the sampling RNG stream.

Step s of both runs of a seed grades rollouts of the same B problems, so the per-step mean rewards are
paired: the report gives ours - TRL over all steps, and over the second half (after some learning): each
seed's mean paired difference, then the 95 % t interval over seeds (stats.paired_seed_difference; seeds are
the independent units), and each side's first-step reward (the same model on the same prompts: equal up to
sampling noise if prompts and grading match), also over seeds. The curves go to one
PNG through plot.py (mean over seeds, min..max band).

    pip install trl                      # benchmark-only dependency (1.16.0 measured)
    python bench/trl_parity.py           # 3 seeds x 10 steps each side, B=8, G=4, lr 2e-5 (about 1 h on 2 cores)
    python bench/trl_parity.py --seeds 0 1 --steps 2   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from vs_trl import TRL_RUN, check_same_problems, lanpo_order, run_child  # noqa: E402  (bench scripts share these)


def lanpo_args(args, seed: int, out: Path) -> list[str]:
    return ["--feedback", "none", "--seed", str(seed), "--steps", str(args.steps),
            "--batch-problems", str(args.batch_problems), "--group-size", str(args.group_size),
            "--max-new-tokens", str(args.max_new_tokens), "--lr", str(args.lr), "--lr-schedule", "constant",
            "--loss-type", "grpo", "--adv-scale", "group", "--beta", "0", "--ppo-epochs", "1",
            "--gen-batch", str(args.batch_problems * args.group_size), "--eval-every", "0",
            "--report-to", "none", "--no-final-checkpoint", "--out-dir", str(out)]


def step_order(args, seed: int) -> list[dict]:
    """The problems lanpo trains on at each step, in order, from lanpo's own functions."""
    import config
    import data

    cfg = config.parse_config(lanpo_args(args, seed, Path("unused")))
    return lanpo_order(data.load_rows(cfg)[0], args.steps, args.batch_problems, seed)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds; each runs both frameworks")
    ap.add_argument("--steps", type=int, default=10, help="training steps per run")
    ap.add_argument("--batch-problems", type=int, default=8, help="B")
    ap.add_argument("--group-size", type=int, default=4, help="G")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="longest completion")
    ap.add_argument("--lr", type=float, default=2e-5, help="constant learning rate (the default run's)")
    ap.add_argument("--out-dir", default="runs/bench/trl_parity",
                    help="runs, results.json and curves.png; a seed whose two runs are there is not rerun")
    args = ap.parse_args()
    if len(set(args.seeds)) < 2:
        raise SystemExit(f"--seeds {' '.join(map(str, args.seeds))}: the interval is over seeds; give at least 2")

    import models
    import stats

    out = Path(args.out_dir)
    model_dir = str(models.embedded_model_dir())
    env = dict(os.environ, WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    curves = {"lanpo": [], "trl": []}
    for seed in args.seeds:
        ours, theirs = out / f"lanpo/seed{seed}", out / f"trl/seed{seed}"
        if not (ours / "metrics.jsonl").exists():
            print(f"seed {seed}: lanpo", flush=True)
            run_child([sys.executable, str(ROOT / "lanpo.py"), "--model", model_dir, *lanpo_args(args, seed, ours)],
                      env)
        if not (theirs / "metrics.jsonl").exists():
            print(f"seed {seed}: TRL", flush=True)
            order = step_order(args, seed)
            theirs.mkdir(parents=True, exist_ok=True)
            (theirs / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in order))
            spec = {"root": str(ROOT), "data": str(theirs / "data.jsonl"), "model": model_dir, "steps": args.steps,
                    "batch_problems": args.batch_problems, "group_size": args.group_size,
                    "max_new_tokens": args.max_new_tokens, "seed": seed, "lr": args.lr, "shuffle": False,
                    "out": str(theirs / "trainer"), "result": str(theirs / "result.json")}
            (theirs / "trl_run.py").write_text(TRL_RUN.format(root=str(ROOT)))
            run_child([sys.executable, str(theirs / "trl_run.py"), json.dumps(spec)], env)
            result = json.loads((theirs / "result.json").read_text())
            check_same_problems(result, order, args.group_size, f"seed {seed}")
            (theirs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in result["records"]))
        curves["lanpo"].append([r["reward_mean"] for r in read_jsonl(ours / "metrics.jsonl")])
        curves["trl"].append([r["reward_mean"] for r in read_jsonl(theirs / "metrics.jsonl")])

    half = args.steps // 2
    summary = {
        "config": vars(args), "curves": curves,
        "all_steps": stats.paired_seed_difference(curves["lanpo"], curves["trl"]),
        "second_half": stats.paired_seed_difference([c[half:] for c in curves["lanpo"]],
                                                    [c[half:] for c in curves["trl"]]),
        "first_step": {side: stats.seed_interval([c[0] for c in curves[side]]) for side in curves},
        "lanpo_mean": stats.seed_interval([sum(c) / len(c) for c in curves["lanpo"]]),
        "trl_mean": stats.seed_interval([sum(c) / len(c) for c in curves["trl"]]),
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    print(f"{len(args.seeds)} seeds x {args.steps} steps, B={args.batch_problems} G={args.group_size}, "
          f"lr {args.lr:g}, {args.max_new_tokens} new tokens")
    for side in curves:
        print(f"  {side:5s} per step (mean over seeds): " + " ".join(
            f"{sum(c[s] for c in curves[side]) / len(curves[side]):.2f}" for s in range(args.steps)))
    print(f"  mean training reward, all steps: lanpo {stats.fmt(*summary['lanpo_mean'])}, "
          f"TRL {stats.fmt(*summary['trl_mean'])}")
    for key, label in (("all_steps", "all steps"), ("second_half", f"steps {half + 1}-{args.steps}")):
        d = summary[key]
        print(f"  lanpo - TRL, {label}: {stats.fmt_diff(d)} (t over {len(args.seeds)} seeds of paired step means, "
              f"p {d['p']:.2f}; per seed " + ", ".join(f"{x:+.3f}" for x in d["per_seed"]) + ")")
    import plot

    png = plot.plot({"lanpo GRPO": [read_jsonl(out / f"lanpo/seed{s}/metrics.jsonl") for s in args.seeds],
                     "TRL GRPOTrainer": [read_jsonl(out / f"trl/seed{s}/metrics.jsonl") for s in args.seeds]},
                    out / "curves.png")
    print(f"  curves: {png}")


if __name__ == "__main__":
    main()
