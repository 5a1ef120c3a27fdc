"""Runs compared: a table of what each run did (printed, and written beside the PNG as .md) and its training
curves overlaid (e.g. GRPO vs LANPO) in one PNG: reward by rollout kind, training accuracy, held-out accuracy
(from step 0), response length, feedback rollouts per kind, feedback through the gradient. A panel no run has
data for is left out.

The table, per run: final training reward, held-out accuracy at the first and last evaluation with the gain
(paired on the same problems, 95 % interval), rollouts per kind, relevance candidates accepted, wall time and
disk; and each run's final held-out accuracy minus the first run's, paired where they evaluated the same
problems.

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

import stats

PANELS = [
    ("reward by rollout kind", ["reward_mean", "scratch/reward", "reflect/reward", "abstract/reward"]),
    ("training accuracy", ["accuracy"]),
    ("held-out accuracy (greedy)", ["eval_accuracy"]),
    ("response length (tokens)", ["response_len_mean"]),
    ("from-scratch rollouts' accuracy (no feedback)", ["scratch/accuracy"]),
    ("feedback rollouts per step", ["reflect/count", "abstract/count"]),
    ("feedback through the gradient", ["self_distill_div", "feedback_model_ce", "distill_is_weight"]),
]
STYLES = {"reward_mean": "-", "scratch/reward": "--", "reflect/reward": ":", "abstract/reward": "-.",
          "self_distill_div": "--", "feedback_model_ce": ":", "distill_is_weight": "-.", "abstract/count": "--"}


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
    logged = {r["step"] for r in records if "eval_accuracy" in r}
    for e in read_heldout(path.parent):  # every evaluation, step 0's too (metrics.jsonl starts at step 1)
        if e["step"] not in logged:
            records.append({"step": e["step"], "eval_accuracy": sum(e["verdicts"]) / len(e["verdicts"])})
    return sorted(records, key=lambda r: r["step"])


def read_heldout(run_dir: Path) -> list[dict]:
    """The run's held-out evaluations (heldout.jsonl: step, problem ids, verdicts), oldest first; [] if none."""
    path = Path(run_dir) / "heldout.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def disk_mb(path: Path) -> float:
    """Bytes under `path` in MB, each file once (checkpoints hard-link unchanged files)."""
    seen, total = set(), 0
    for f in Path(path).rglob("*"):
        if f.is_file() and (st := f.stat()).st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_size
    return total / 1e6


def run_table(runs: dict[str, Path]) -> str:
    """The markdown table of what each run did (see the module docstring); `runs`: name -> run directory."""
    rows = ["| run | steps | final training reward | held-out first -> last | gain [95 %] | scratch / reflect / "
            "abstract rollouts | relevance accepted | wall time | disk | last held-out minus the first run's |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    base = None
    for name, run_dir in runs.items():
        records = [r for r in read_metrics(run_dir) if "reward_mean" in r]
        evals = read_heldout(run_dir)
        held, gain, versus = "-", "-", "-"
        if evals:
            first, last = evals[0], evals[-1]
            held = (f"{stats.fmt(*stats.interval([first['verdicts']]))} (step {first['step']}) -> "
                    f"{stats.fmt(*stats.interval([last['verdicts']]))} (step {last['step']})")
            if len(evals) > 1 and first["ids"] == last["ids"]:
                gain = stats.fmt_diff(stats.paired_difference([last["verdicts"]], [first["verdicts"]]))
            if base is None:
                base = last
            elif base["ids"] == last["ids"]:
                versus = stats.fmt_diff(stats.paired_difference([last["verdicts"]], [base["verdicts"]]))
            else:
                versus = "other problems"
        counts = " / ".join(str(int(sum(r.get(f"{kind}/count", 0) for r in records)))
                            for kind in ("scratch", "reflect", "abstract"))
        candidates = sum(r.get("relevance_candidates", 0) for r in records)
        accepted = sum(r.get("relevance_candidates", 0) * r.get("relevance_accept_rate", 0) for r in records)
        relevance = f"{accepted:.0f} of {candidates:.0f}" if candidates else "-"
        seconds = sum(r.get("time_step", 0) + r.get("time_eval", 0) for r in records)
        final = f"{records[-1]['reward_mean']:.3f}" if records else "-"
        rows.append(f"| {name} | {records[-1]['step'] if records else 0} | {final} | {held} | {gain} | {counts} | "
                    f"{relevance} | {seconds / 60:.1f} min | {disk_mb(run_dir):.1f} MB | {versus} |")
    return "\n".join(rows)


def panels_with_data(runs: dict[str, list[list[dict]]]) -> list[tuple[str, list[str]]]:
    """The PANELS some run logged a value for (a GRPO run draws no feedback panels)."""
    return [(title, keys) for title, keys in PANELS
            if any(r.get(key) for seeds in runs.values() for records in seeds for r in records for key in keys)]


def plot(runs: dict[str, list[list[dict]]], out: str | Path) -> Path:
    """`runs`: legend name -> the metrics of each of its seeds (one or more runs)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = panels_with_data(runs)
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.7 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys) in zip(axes.flat, panels):
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
    dirs: dict[str, list[Path]] = {}
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
        dirs.setdefault(name, []).append(Path(path) if Path(path).is_dir() else Path(path).parent)
    table = run_table({name if len(d) == 1 else f"{name} seed {i}": run_dir for name, d in dirs.items()
                       for i, run_dir in enumerate(d)})
    print(table)
    path = plot(runs, args.out)
    Path(path).with_suffix(".md").write_text(table + "\n")
    print(f"wrote {path} and {Path(path).with_suffix('.md')}")
    return path


if __name__ == "__main__":
    main()
