"""Training curves from one or more runs' metrics.jsonl, overlaid (e.g. GRPO vs LANPO), as one PNG:
reward by rollout kind, training accuracy, held-out eval accuracy, response length.

    python plot.py runs/ablate/grpo runs/ablate/lanpo -o curves.png
    python plot.py grpo=runs/a/grpo sd-0.1=runs/b/lanpo+self-distill -o curves.png   # legend names
    python plot.py grpo=runs/bench/learning/grpo/seed{0,1,2} lanpo=runs/bench/learning/lanpo/seed{0,1,2}

Several runs under one NAME= are seeds of one arm: drawn as their mean, with a band from the lowest to the
highest seed at each step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = [
    ("reward by rollout kind", ["reward_mean", "scratch/reward", "reflect/reward", "abstract/reward"]),
    ("training accuracy", ["accuracy"]),
    ("held-out accuracy (greedy)", ["eval_accuracy"]),
    ("response length (tokens)", ["response_len_mean"]),
    ("from-scratch rollouts' accuracy (no feedback)", ["scratch/accuracy"]),
    ("feedback through the gradient", ["self_distill_div", "feedback_model_ce", "distill_is_weight"]),
]
STYLES = {"reward_mean": "-", "scratch/reward": "--", "reflect/reward": ":", "abstract/reward": "-.",
          "self_distill_div": "--", "feedback_model_ce": ":", "distill_is_weight": "-."}


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl" if Path(run_dir).is_dir() else Path(run_dir)
    if not path.exists():
        raise SystemExit(f"{path}: no metrics file (pass a run directory or its metrics.jsonl)")
    records = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise SystemExit(f"{path}: line {line_no} is not JSON") from None
    if not records:
        raise SystemExit(f"{path}: empty")
    return records


def plot(runs: dict[str, list[list[dict]]], out: str | Path) -> Path:
    """`runs`: legend name -> the metrics of each of its seeds (one or more runs)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(3, 2, figsize=(11, 11))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for i, (name, seeds) in enumerate(runs.items()):
            for key in keys:
                by_step: dict[int, list[float]] = {}
                for records in seeds:
                    for r in records:
                        if key in r:
                            by_step.setdefault(r["step"], []).append(r[key])
                if not by_step:
                    continue
                xs = sorted(by_step)
                color = colors[i % len(colors)]
                label = name if len(keys) == 1 else f"{name}: {key}"
                if len(seeds) > 1:
                    label += f" ({len(seeds)} seeds)"
                    ax.fill_between(xs, [min(by_step[x]) for x in xs], [max(by_step[x]) for x in xs],
                                    color=color, alpha=0.15, linewidth=0)
                ax.plot(xs, [sum(by_step[x]) / len(by_step[x]) for x in xs], STYLES.get(key, "-"), color=color,
                        marker=".", label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files), each optionally "
                    "NAME=PATH to set its legend name (default: the run directory's name); runs given the "
                    "same NAME= are seeds of one arm (mean and min..max band)")
    ap.add_argument("-o", "--out", default="runs/curves.png", help="PNG to write")
    args = ap.parse_args(argv)
    runs: dict[str, list[list[dict]]] = {}
    implicit: set[str] = set()
    for arg in args.runs:
        name, _, path = arg.rpartition("=") if "=" in arg and not Path(arg).exists() else ("", "", arg)
        if not name:
            name = Path(path).name if Path(path).is_dir() else Path(path).parent.name
            if name in runs:
                raise SystemExit(f"two runs are named {name!r}: label them, e.g. {name}-2={path} (or give both "
                                 f"{name}=... if they are seeds of one arm)")
            implicit.add(name)
        elif name in implicit:
            raise SystemExit(f"{name}={path}: {name!r} already names an unlabelled run; label every seed")
        runs.setdefault(name, []).append(read_metrics(path))
    path = plot(runs, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
