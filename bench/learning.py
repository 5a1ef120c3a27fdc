"""Does training teach, and by how much? Arms with the same budget (the default run's settings plus the
flags below) on the embedded SmolLM2-135M and the built-in data, each over several seeds; held-out greedy
accuracy (no feedback at test time) of the base model and of each final model on the same problems.

Reported per arm: accuracy and its gain over the base model, each arm minus the first arm (paired on the
same problems), and the area under the training-reward curve (mean reward_mean over the steps), each with
its 95 % t interval over seeds (the seeds are the independent units; stats.paired_seed_difference) and
p-value; with one seed, bootstrap intervals over the problems instead (said in the table's header). For each
feedback arm, a second table: its reflection and abstraction rollouts against those from scratch in the same
steps, pooled over seeds, and the judge's precision where the data has families (a channel that never fired
says so).
Per-problem verdicts are kept, so any other comparison can be made later.

    python bench/learning.py                          # GRPO vs LANPO, 3 seeds, 8 steps, 256 held-out (~1 h)
    python bench/learning.py --seeds 0 --steps 2 --eval-size 32 --out-dir runs/bench/smoke   # smoke run
    python bench/learning.py --arms grpo-fp32 grpo-bf16-mixed --out-dir runs/bench/precision-learning  # ~50 min
    python bench/learning.py --arms grpo lanpo lanpo-raw lanpo-gamma0 --eval-size 121 --lr 1e-4 -- \
        --dataset synthetic:rules-menu --levels 1-2 --model qwen2.5-coder-1.5b --dtype bf16 --lora-rank 16
An interrupted benchmark continues where it stopped when run again with the same --out-dir: finished
runs are kept (their verdicts.json), nothing is run twice. Each result records the flags that made it; one
made with other settings stops the bench with the settings that differ (memory-only settings aside, so a
rerun with a smaller --micro-batch or --gen-batch still pairs with the runs before it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import config  # noqa: E402
import data  # noqa: E402
import models  # noqa: E402
import plot  # noqa: E402
import rundir  # noqa: E402
import scoring  # noqa: E402
import stats  # noqa: E402

ARMS = {  # name -> the flags that make it (on top of the common ones)
    "grpo": ["--feedback", "none"],
    "lanpo": ["--feedback", "both"],
    "lanpo+distill": ["--feedback", "both", "--feedback-grad", "distill"],
    "lanpo+self-distill": ["--feedback", "both", "--self-distill-coef", "0.1"],
    "lanpo+feedback-model": ["--feedback", "both", "--feedback-model-coef", "0.1"],
    "lanpo+strip": ["--feedback", "both", "--feedback-grad", "strip"],
    "lanpo-raw": ["--feedback", "both", "--abstract-mode", "raw"],
    "lanpo-gamma0": ["--feedback", "both", "--relevance-threshold", "0", "--relevance-top", "0"],  # no filter
    "lanpo-solved": ["--feedback", "both", "--abstract-from", "solved"],  # abstraction from solved problems only
    "lanpo-solved-gamma0": ["--feedback", "both", "--abstract-from", "solved", "--relevance-threshold", "0",
                            "--relevance-top", "0"],  # the same without the judge: every retrieved candidate
    # the same with a perfect judge (synthetic:rules data only): the control for retrieval, principles and update
    "lanpo-solved-oracle": ["--feedback", "both", "--abstract-from", "solved", "--relevance-judge", "family",
                            "--relevance-threshold", "0.5"],
    "leak-gold": ["--feedback", "reflect", "--reflect-mode", "with-gold"],  # the labelled upper bound
    # precision: the same GRPO in fp32 and in bf16-mixed (both final models evaluated alike, in the common dtype)
    "grpo-fp32": ["--feedback", "none", "--dtype", "fp32"],
    "grpo-bf16-mixed": ["--feedback", "none", "--dtype", "bf16-mixed"],
}


def arm_flags(name: str, common: list[str], seed: int) -> list[str]:
    """The lanpo.py flags of one run: the common ones, then the arm's, which win where both set a flag (an arm
    is what it says: lanpo-gamma0 has no relevance filter whatever the common flags filter with)."""
    return [*common, *ARMS[name], "--seed", str(seed)]


def overridden(name: str, common: list[str]) -> list[str]:
    """The common flags that an arm sets again (its value is the one used)."""
    return sorted({f for f in ARMS[name] if f.startswith("--")} & {f for f in common if f.startswith("--")})


def heldout_rows(cfg: config.Config) -> list[dict]:
    """The held-out problems a run with this config evaluates on (they depend on its seed)."""
    return data.load_problems(cfg.dataset, cfg.eval_split, size=cfg.eval_size, seed=cfg.seed,
                              levels=data.parse_levels(cfg.levels), train_size=cfg.synthetic_size)[0]


def verdicts(model_dir: str, rows: list[dict], cfg: config.Config) -> list[float]:
    """Greedy verdict per held-out problem, through the code path training's eval uses."""
    tokenizer = models.load_tokenizer(model_dir)
    # every arm, and the base model, in the dtype the common flags name; auto: fp32, whatever the arms trained in
    model = models.load_for_inference(model_dir, cfg.dtype, cfg.cpu_rows_first_matmul, cfg.cpu_host_memory)
    records, _ = scoring.evaluate_rows(model, tokenizer, rows, "zero-shot", cfg, models.eos_token_ids(model, tokenizer))
    return [r["verdicts"][0] for r in records]


def changed_flags(recorded: list[str], flags: list[str]) -> list[str]:
    """The settings (as config.Config fields) on which two flag lists differ, memory-only ones aside."""
    old, new = config.parse_config(recorded), config.parse_config(flags)
    return [f.name for f in dataclasses.fields(old)
            if f.name not in rundir.MEMORY_ONLY and getattr(old, f.name) != getattr(new, f.name)]


def cached(path: Path, compute, flags: list[str]) -> dict:
    """The JSON at `path`, computed and written first if missing (so a rerun skips finished work). A result
    records the lanpo.py flags that made it: reused under other flags, it would be silently another
    experiment, so that stops with the settings that differ."""
    if not path.exists():
        result = {**compute(), "flags": flags}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(result))
        path.with_suffix(".tmp").replace(path)
    result = json.loads(path.read_text())
    if "flags" not in result:
        raise SystemExit(f"{path} does not record the flags that made it: move it away and rerun")
    changed = changed_flags(result["flags"], flags)
    if changed:
        raise SystemExit(f"{path} was made with other settings ({', '.join(changed)}): use another --out-dir, or "
                         f"move it away and rerun")
    return result


def train_and_evaluate(name: str, seed: int, common: list[str], rows: list[dict], cfg: config.Config,
                       run_dir: Path) -> dict:
    if run_dir.exists():
        raise SystemExit(f"{run_dir} holds an unfinished run (no verdicts.json): move it away and rerun")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "lanpo.py"), *arm_flags(name, common, seed),
                           "--out-dir", str(run_dir)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"arm {name} seed {seed} failed:\n{done.stderr[-3000:]}")
    train_s = time.perf_counter() - t0
    # the run's metrics go into the result, so that a results folder without its run folders (bench/results/,
    # committed) still draws the curves
    return {"verdicts": verdicts(str(run_dir / "final"), rows, cfg), "train_s": train_s,
            "metrics": plot.read_metrics(run_dir)}


def per_seed(difference: dict) -> str:
    """' (seeds +0.066, -0.012)' when the difference is over seeds: with few seeds, each one is worth seeing."""
    values = difference.get("per_seed", [])
    return f" (seeds {', '.join(f'{v:+.3f}' for v in values)})" if len(values) > 1 else ""


def channel_verdicts(metrics: list[dict], kind: str) -> tuple[list[float], list[float]]:
    """The right (1) and wrong (0) rollouts of feedback kind `kind` ("reflect", "abstract") and those from
    scratch, over the steps where both ran (a step's count times its accuracy is its right rollouts)."""
    mine, scratch = [], []
    for r in metrics:
        if r.get(f"{kind}/count") and r.get("scratch/count"):
            for name, into in ((kind, mine), ("scratch", scratch)):
                count = int(r[f"{name}/count"])
                right = round(count * r[f"{name}/accuracy"])
                into += [1.0] * right + [0.0] * (count - right)
    return mine, scratch


def channel_lines(arms: list[str], common: list[str], seeds: list[int], final: dict) -> list[str]:
    """A table of the feedback rollouts inside each feedback arm's runs against those from scratch in the same
    steps, pooled over seeds (rollouts treated as independent), with each seed's difference and the range over
    steps of the judge's precision where the data has families; a channel that never fired is said so."""
    lines = ["", "feedback rollouts inside the runs against those from scratch in the same steps, pooled over seeds "
             "(rollouts treated as independent: bootstrap over rollouts)", "",
             "| arm | channel | right / rollouts | from scratch, same steps | difference (p) | per seed | "
             "judge precision over steps |", "|---|---|---|---|---|---|---|"]
    for name in arms:
        cfg = config.parse_config(arm_flags(name, common, seeds[0]))
        for kind, on in (("reflect", cfg.uses_reflection), ("abstract", cfg.wants_lessons)):
            if not on or cfg.feedback_ratio == 0:
                continue
            by_seed = {s: channel_verdicts(final[name][s]["metrics"], kind) for s in seeds}
            mine = [v for s in seeds for v in by_seed[s][0]]
            scratch = [v for s in seeds for v in by_seed[s][1]]
            precision = [r["relevance_precision"] for s in seeds for r in final[name][s]["metrics"]
                         if kind == "abstract" and not math.isnan(r.get("relevance_precision", math.nan))]
            judged = f"{min(precision):.2f}-{max(precision):.2f}" if precision else ""
            if not mine:
                lines.append(f"| {name} | {kind} | 0 / 0: never fired | | | | {judged} |")
                continue
            d = stats.unpaired_difference(mine, scratch)
            seeds_d = ", ".join(f"{sum(m) / len(m) - sum(b) / len(b):+.3f}" if m else "none"
                                for m, b in (by_seed[s] for s in seeds))
            lines.append(f"| {name} | {kind} | {sum(mine):.0f} / {len(mine)} ({sum(mine) / len(mine):.3f}) | "
                         f"{sum(scratch):.0f} / {len(scratch)} ({sum(scratch) / len(scratch):.3f}) | "
                         f"{stats.fmt_diff(d)} (p {d['p']:.3f}) | {seeds_d} | {judged} |")
    return lines if len(lines) > 5 else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", nargs="+", default=["grpo", "lanpo"], choices=list(ARMS),
                    help="the first arm is the one the others are compared with")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="one run per arm and seed")
    ap.add_argument("--steps", type=int, default=8, help="training steps of every run")
    ap.add_argument("--lr", type=float, default=2e-5,
                    help="learning rate of every arm (the default 2e-6 is a 7B-scale value that barely moves 135M)")
    ap.add_argument("--eval-size", type=int, default=256, help="held-out problems per seed")
    ap.add_argument("--out-dir", default="runs/bench/learning")
    ap.add_argument("flags", nargs="*", help="more lanpo.py flags for every run, after --")
    args = ap.parse_args()
    out = Path(args.out_dir)
    common = ["--steps", str(args.steps), "--lr", str(args.lr), "--eval-size", str(args.eval_size),
              "--eval-every", "0", "--no-final-checkpoint", "--report-to", "none", *args.flags]

    for name in args.arms:
        if again := overridden(name, common):
            print(f"arm {name} sets {', '.join(again)} over the common flags", flush=True)
    base, final, curves = {}, {name: {} for name in args.arms}, {name: [] for name in args.arms}
    for seed in args.seeds:
        cfg = config.parse_config(common + ["--seed", str(seed)])
        rows = heldout_rows(cfg)
        base[seed] = cached(out / f"base/seed{seed}.json", lambda: {"verdicts": verdicts(cfg.model, rows, cfg)},
                            common + ["--seed", str(seed)])["verdicts"]
        for name in args.arms:
            run_dir = out / name / f"seed{seed}"
            final[name][seed] = cached(out / name / f"seed{seed}.json",
                                       lambda: train_and_evaluate(name, seed, common, rows, cfg, run_dir),
                                       arm_flags(name, common, seed))
            if "metrics" not in final[name][seed]:
                raise SystemExit(f"{out / name}/seed{seed}.json does not hold its run's metrics: move it away "
                                 "and rerun")
            curves[name].append(final[name][seed]["metrics"])
            print(f"{name} seed {seed}: base {sum(base[seed]) / len(rows):.3f} -> "
                  f"{sum(final[name][seed]['verdicts']) / len(rows):.3f}", flush=True)

    seeds = args.seeds
    over_seeds = len(seeds) > 1
    interval = ((lambda groups: stats.seed_interval([sum(g) / len(g) for g in groups])) if over_seeds
                else stats.interval)
    difference = stats.paired_seed_difference if over_seeds else stats.paired_difference
    auc = {name: [sum(r["reward_mean"] for r in c) / len(c) for c in curves[name]] for name in args.arms}
    summary = {"base": interval([base[s] for s in seeds]), "arms": {}}
    how = ("t intervals over the seeds' values" if over_seeds else "one seed: bootstrap intervals over the problems")
    lines = [f"held-out greedy accuracy, {args.eval_size} problems x {len(seeds)} seeds, {args.steps} steps, "
             f"lr {args.lr}; 95 % {how}",
             "", "| arm | accuracy | gain over base (p) | vs " + args.arms[0] + " (paired) | p | training reward, "
             "mean over steps | train min/run |", "|---|---|---|---|---|---|---|",
             f"| base | {stats.fmt(*summary['base'])} | | | | | |"]
    for name in args.arms:
        ends = [final[name][s]["verdicts"] for s in seeds]
        gain = difference(ends, [base[s] for s in seeds])
        versus = difference(ends, [final[args.arms[0]][s]["verdicts"] for s in seeds])
        minutes = sum(final[name][s]["train_s"] for s in seeds) / len(seeds) / 60
        accuracy = interval(ends)
        reward = stats.seed_interval(auc[name]) if over_seeds else (auc[name][0],) * 3
        summary["arms"][name] = {"accuracy": accuracy, "gain": gain, "vs_first": versus, "train_minutes": minutes,
                                 "reward_auc": reward, "reward_auc_per_seed": auc[name]}
        vs, p = ("", "") if name == args.arms[0] else (stats.fmt_diff(versus) + per_seed(versus), f"{versus['p']:.3f}")
        lines.append(f"| {name} | {stats.fmt(*accuracy)} | {stats.fmt_diff(gain)}{per_seed(gain)} (p {gain['p']:.3f}) "
                     f"| {vs} | {p} | {stats.fmt(*reward)} | {minutes:.1f} |")
    lines += channel_lines(args.arms, common, seeds, final)
    png = plot.plot(curves, out / "learning.png")
    table = "\n".join(lines) + f"\n\ncurves (mean over seeds, band = min..max): {png}\n"
    (out / "learning.md").write_text(table)
    (out / "learning.json").write_text(json.dumps({"args": vars(args), **summary}, indent=2))
    print(table)


if __name__ == "__main__":
    main()
