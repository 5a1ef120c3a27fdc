"""Evaluation: accuracy of a model or checkpoint on math benchmarks, without feedback (zero-shot) or with
it at test time (reflect, abstract; see scoring.py), each accuracy with its 95 % interval. The settings it
shares with training (--max-new-tokens, --attempt-tokens, --relevance-threshold, ...) are config.Config's
fields, with the same names, help and defaults: one definition. Evaluation's own: --samples, --temperature
(default 0 = greedy), --benchmarks, --limit, --mode, --pool.

    python evaluate.py --model runs/default/final --benchmarks synthetic:arith --limit 256
    python evaluate.py --model Qwen2.5-7B --benchmarks math500 aime24 --samples 8 --temperature 0.6 \
        --max-new-tokens 2048
    python evaluate.py --compare runs/eval/grpo runs/eval/lanpo   # A - B on the same problems, paired bootstrap

Nothing evaluated was trained on: when --model is a run of lanpo.py (its directory, final/ or a checkpoint),
the benchmark problems that are its training problems in other words (data.held_out_twins) are left out and
named (--eval-overlap refuse stops instead); with --pool, pool problems that are evaluated ones are dropped.

Outputs under --out-dir: summary.json, summary.md (every accuracy with its interval) and problems.jsonl
(prompt, responses, extracted answers, verdicts per problem). Accuracy is the math grader's; with
--reward module:function each response is also scored by that function (`rewards`, summary `reward`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

import torch

import abstract
import config
import cpu
import data
import models
import reflect
import reward
import rundir
import scoring
import stats
from pool import EmbeddingIndex, ExperiencePool

TRUNCATION_WARNING = 0.2  # a summary with more of its responses cut than this says so
WHOLE_NUMBERS = ("problems", "max_new_tokens")  # summary keys printed as integers

# --max-new-tokens when none is given, by benchmark name: of the measured budgets (48-1024; 256-2048 for the 1.5B),
# the smallest past which the largest would finish at most 5 % more of the greedy responses, the largest over
# SmolLM2-135M, Qwen2.5-Coder-0.5B and Qwen2.5-Coder-1.5B (math500, amc23) (bench/eval_budgets.py; docs/evaluation.md
# has the table; aime25 takes aime24's). Any other benchmark gets training's default.
TOKEN_BUDGETS = {"synthetic:arith": 128, "gsm8k": 512, "math500": 2048, "amc23": 1024, "aime24": 1024, "aime25": 1024}

# the settings evaluation shares with training (Config fields marked evaluation=True): flags, help and defaults
# are training's (but --max-new-tokens's default: TOKEN_BUDGETS), and every one that shapes a prompt goes through
# training's builders
SHARED = tuple(f.name for f in dataclasses.fields(config.Config) if f.metadata.get("evaluation"))


def compare(a_dir: str, b_dir: str) -> str:
    """A - B per benchmark and mode (and over everything), paired on the problems both evaluated: the
    difference of each accuracy metric, its 95 % interval and p-value, as a markdown table."""
    runs = []
    for d in (a_dir, b_dir):
        path = Path(d) / "problems.jsonl"
        if not path.is_file():
            raise SystemExit(f"--compare {d}: no problems.jsonl there (an evaluate.py --out-dir)")
        runs.append({(r["benchmark"], r["mode"], r["id"]): r for r in map(json.loads, path.open(encoding="utf-8"))})
    a, b = runs
    if a.keys() != b.keys():
        only = sorted(a.keys() ^ b.keys())[:3]
        raise SystemExit(f"--compare: {a_dir} and {b_dir} evaluated different problems (e.g. {only}); a paired "
                         "comparison needs the same --benchmarks, --limit, --seed and --mode")
    k = {len(r["verdicts"]) for r in (*a.values(), *b.values())}
    if len(k) != 1:
        raise SystemExit(f"--compare: the two evaluations drew different --samples per problem ({sorted(k)})")
    samples = k.pop()
    metrics = list(scoring.per_problem_scores([next(iter(a.values()))], samples))
    lines = [f"A = {a_dir}, B = {b_dir}: A - B [95 % interval] (paired bootstrap p-value)", "",
             "| benchmark | mode | problems | " + " | ".join(metrics) + " |", "|---|---|---|" + "---|" * len(metrics)]
    parts = sorted({(bench, mode) for bench, mode, _ in a})
    benches = {bench for bench, _ in parts}
    for bench, mode in parts + ([("overall", m) for m in sorted({m for _, m in parts})] if len(benches) > 1 else []):
        keys = [key for key in a if key[1] == mode and bench in ("overall", key[0])]
        sa = scoring.per_problem_scores([a[key] for key in keys], samples)
        sb = scoring.per_problem_scores([b[key] for key in keys], samples)
        cells = []
        for metric in sa:
            d = stats.paired_difference([sa[metric]], [sb[metric]])
            cells.append(f"{stats.fmt_diff(d)} (p {d['p']:.3f})")
        lines.append(f"| {bench} | {mode} | {len(keys)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ CLI

def load_benchmark(name: str, limit: int, seed: int, split: str, levels: list[int], synthetic_size: int,
                   **fields) -> list[dict]:
    """Rows of anything lanpo.py's --dataset takes (data.load_problems: a benchmark name, a data file,
    synthetic:arith, a hub id), read with the same field flags. --limit takes a seeded random subset, so repeated
    runs see the same problems. synthetic:arith gives the held-out problems of a training run with the same
    --seed, --levels and --synthetic-size (none shares its arithmetic with that run's training problems)."""
    synthetic = name.startswith("synthetic:")
    rows, _ = data.load_problems(name, "test" if synthetic else split, size=max(limit, 0) if synthetic else 0,
                                 seed=seed, levels=levels, train_size=synthetic_size, **fields)
    if limit and limit < len(rows):
        rows = random.Random(seed).sample(rows, limit)
    if not rows:
        raise SystemExit(f"benchmark {name}: the subset is empty")
    return rows


def markdown_table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """One row per (benchmark, mode), one column per metric; an accuracy shows its 95 % interval."""
    keys = sorted({k for modes in results.values() for m in modes.values() for k in m
                   if not k.endswith(("_low", "_high"))}, key=_metric_order)
    lines = ["| benchmark | mode | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for bench, modes in results.items():
        for mode, m in modes.items():
            cells = []
            for k in keys:
                if k not in m:
                    cells.append("")
                elif k in WHOLE_NUMBERS:
                    cells.append(f"{int(m[k])}")
                elif f"{k}_low" in m:
                    cells.append(stats.fmt(m[k], m[f"{k}_low"], m[f"{k}_high"]))
                else:
                    cells.append(f"{m[k]:.3f}")
            lines.append(f"| {bench} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _metric_order(key: str) -> tuple:
    order = ["problems", "avg", "pass", "maj", "response_len", "truncated", "with_lessons", "turn2_avg",
             "turn2_pass", "turn2_maj", "turn2_response_len", "turn2_truncated", "flip_wrong_to_right",
             "flip_right_to_wrong"]
    base = key.split("@")[0]
    number = int(key.split("@")[1]) if "@" in key else 0
    return (order.index(base) if base in order else len(order), number, key)


def overall(per_bench: dict[str, tuple[list[dict], dict]], samples: int) -> dict[str, float]:
    """Metrics over all problems of all benchmarks (problem-weighted)."""
    records = [r for recs, _ in per_bench.values() for r in recs]
    out = scoring.summarize(records, samples)
    if records and "turn2_verdicts" in records[0]:
        out.update(scoring.turn2_summary(records, samples))
    return out


def training_rows_of(model: str) -> tuple[Path, list[dict]] | None:
    """(run directory, its training problems) when `model` is a run made by lanpo.py (the run directory, its
    final/, or a checkpoint under it): the problems as the run loaded them, from its config.json. None otherwise."""
    path = Path(model)
    for run in (path, path.parent, path.parent.parent):
        if (run / "config.json").is_file() and (run / "metrics.jsonl").is_file():
            known = {f.name for f in dataclasses.fields(config.Config)}
            settings = {k: v for k, v in rundir.read_settings(run).items() if k in known}
            try:
                return run, data.load_rows(config.Config(**settings))[0]
            except SystemExit as e:  # moved data: say why a run's data is read at all
                raise SystemExit(f"{run / 'config.json'}: cannot load the run's training problems, which "
                                 f"evaluation leaves out of the benchmarks: {e}") from None
    return None


def drop_training_twins(trained: tuple[Path, list[dict]], benchmarks: dict[str, list[dict]], refuse: bool) -> list:
    """Leave out of each benchmark the problems that the evaluated run trained on in other words
    (data.held_out_twins), saying how many; with `refuse`, stop instead and name them. Returns the
    (training id, evaluated id, how) triples."""
    run, train_rows = trained
    found = []
    for name, rows in benchmarks.items():
        twins = data.held_out_twins(train_rows, rows)
        if not twins:
            continue
        shown = ", ".join(f"{e} = {t} ({how})" for t, e, how in twins[:3]) + (" ..." if len(twins) > 3 else "")
        if refuse:
            raise SystemExit(f"{name}: {len(twins)} evaluated problems are training problems of {run} in other "
                             f"words: {shown} (--eval-overlap drop leaves them out)")
        seen = {e for _, e, _ in twins}
        benchmarks[name] = [r for r in rows if r["id"] not in seen]
        if not benchmarks[name]:
            raise SystemExit(f"{name}: every evaluated problem is a training problem of {run} in other words: "
                             "evaluate it on problems it did not train on")
        print(f"{name}: left out {len(seen)} problems that {run} trained on in other words: {shown}")
        found += twins
    return found


def drop_pool_twins(pool: ExperiencePool, benchmarks: dict[str, list[dict]], quiet: bool = False) -> list:
    """Remove from the pool every problem that is an evaluated one in other words (its text up to layout, or
    its operands and answer): its trials would show the evaluated problem's answer. Returns (pool id, evaluated
    id) pairs, and says how many."""
    twins = pool.twins_of([row for rows in benchmarks.values() for row in rows])
    for pool_id, _ in twins:
        pool.remove(pool_id)
    if twins and not quiet:
        print(f"--pool: dropped {len(twins)} pool problems that are evaluated problems in other words, e.g. "
              + ", ".join(f"{p} = {e}" for p, e in twins[:3]))
    return twins


def main(argv: list[str] | None = None) -> dict:
    ap = config.FlagParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    config.add_flags(ap, [name for name in SHARED if name != "max_new_tokens"])
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"longest response (cut ones score 0 and are counted); default: the benchmark's budget "
                         f"({', '.join(f'{k} {v}' for k, v in TOKEN_BUDGETS.items())}), else "
                         f"{config.Config.max_new_tokens}")
    ap.add_argument("--benchmarks", nargs="+", default=["gsm8k", "math500"],
                    help=f"anything --dataset takes: names {sorted(data.BENCHMARKS)}, file paths, synthetic:arith, "
                         "synthetic:rules(-menu, -choice), or a hub id (hub:<id> or owner/name)")
    ap.add_argument("--mode", nargs="+", default=["zero-shot"], choices=scoring.MODES, help="evaluation modes")
    ap.add_argument("--pool", default="", help="training pool.jsonl for --mode abstract (never test answers)")
    ap.add_argument("--split", default="test", help="split of hub datasets")
    ap.add_argument("--limit", type=int, default=0, help="seeded random subset of N problems per benchmark (0 = all)")
    ap.add_argument("--samples", type=int, default=1, help="k: responses per problem")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--out-dir", default="runs/eval", help="summary.json, summary.md, problems.jsonl")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None,
                    help="instead of evaluating: A - B of two --out-dirs on the same problems (paired bootstrap)")
    args = ap.parse_args(config.current_spelling(argv))
    if args.compare:
        table = compare(*args.compare)
        print(table)
        return {"compare": table}

    cfg = config.Config(**{name: getattr(args, name) for name in SHARED if name != "max_new_tokens"},
                        max_new_tokens=args.max_new_tokens or config.Config.max_new_tokens)  # training's settings
    config.check_config(cfg)  # and its range checks
    for flag, least in (("samples", 1), ("limit", 0)):
        if getattr(args, flag) < least:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    if args.temperature < 0:
        raise SystemExit(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    out_dir = Path(args.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise SystemExit(f"--out-dir {out_dir} is a file, not a directory: choose another --out-dir")
    if (out_dir / "summary.json").exists() or (out_dir / "problems.jsonl").exists():
        raise SystemExit(f"{out_dir} already holds an evaluation: choose another --out-dir (nothing was changed)")
    if args.temperature == 0 and args.samples != 1:
        raise SystemExit("greedy decoding (--temperature 0) gives one distinct sample: use --samples 1")
    least = reflect.MODES[args.reflect_mode].least_attempts
    if "reflect" in args.mode and args.samples < least:
        raise SystemExit(f"--reflect-mode {args.reflect_mode} shows at least {least} first attempts of a problem: "
                         f"use --samples {least} or more")
    pool = None
    if "abstract" in args.mode:
        if not args.pool:
            raise SystemExit("--mode abstract needs --pool (a pool.jsonl saved by a training run)")
        if not Path(args.pool).is_file():
            raise SystemExit(f"--pool {args.pool}: file not found (a run's checkpoints/step-N/pool.jsonl)")
        pool = ExperiencePool(args.pool_per_problem, args.pool_max_problems)
        pool.load(args.pool)  # checked now; under --retriever policy it is indexed again once the model is here
    # every benchmark is loaded and checked before the model is
    levels = data.parse_levels(args.levels)
    fields = {"data_dir": Path(args.data_dir) if args.data_dir else data.DATA_DIR, "id_field": args.id_field,
              "problem_field": args.problem_field, "answer_field": args.answer_field, "skip_bad": args.skip_bad_rows}
    benchmarks = {Path(name).name: load_benchmark(name, args.limit, args.seed, args.split, levels,
                                                  args.synthetic_size, **fields)
                  for name in args.benchmarks}  # a file path is shown by its file name
    pool_twins = drop_pool_twins(pool, benchmarks) if pool is not None else []
    trained = training_rows_of(args.model)
    training_twins = drop_training_twins(trained, benchmarks, args.eval_overlap == "refuse") if trained else []
    models.check_available(args.model)
    rewarder = reward.Rewarder(args.reward, args.reward_timeout) if args.reward != reward.MATH else None

    tokenizer = models.load_tokenizer(args.model)
    precision, why = config.resolve_dtype(args.dtype, torch.cuda.is_available(), cpu.native_bf16(), sharded=False)
    if why:
        print(why)
    model = models.load_for_inference(args.model, precision, args.cpu_rows_first_matmul, args.cpu_host_memory)
    eos_ids = models.eos_token_ids(model, tokenizer)
    if pool is not None and args.retriever == "policy":  # retrieval by the policy's hidden states, as in training
        pool = ExperiencePool(args.pool_per_problem, args.pool_max_problems,
                              EmbeddingIndex(abstract.hidden_state_embedder(model, tokenizer)))
        pool.load(args.pool)
        drop_pool_twins(pool, benchmarks, quiet=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict[str, float]]] = {}
    args.mode = sorted(set(args.mode), key=scoring.MODES.index)  # zero-shot first: reflect reuses it as turn 1
    by_mode: dict[str, dict[str, tuple]] = {m: {} for m in args.mode}
    with open(out_dir / "problems.jsonl", "w", encoding="utf-8") as f:
        for name, rows in benchmarks.items():
            budget = args.max_new_tokens or TOKEN_BUDGETS.get(name, config.Config.max_new_tokens)
            for mode in args.mode:
                torch.manual_seed(args.seed)
                t0 = time.perf_counter()
                zero_shot = by_mode.get("zero-shot", {}).get(name, (None,))[0]  # reflect's turn 1, already run
                records, summary = scoring.evaluate_rows(
                    model, tokenizer, rows, mode, dataclasses.replace(cfg, max_new_tokens=budget), eos_ids, pool,
                    zero_shot, rewarder, f"{name} [{mode}]", args.samples, args.temperature)
                summary["max_new_tokens"], summary["seconds"] = float(budget), time.perf_counter() - t0
                if args.cpu_host_memory == "trim" and not torch.cuda.is_available():
                    cpu.trim_freed_host_memory()  # what this benchmark's sampling freed, before the next one
                results.setdefault(name, {})[mode] = summary
                by_mode[mode][name] = (records, summary)
                for r in records:
                    f.write(json.dumps({"benchmark": name, "mode": mode, **r}, ensure_ascii=False) + "\n")
                print(f"{name} [{mode}]: " + ", ".join(
                    f"{k}={stats.fmt(v, summary[k + '_low'], summary[k + '_high'])}" if k + "_low" in summary
                    else f"{k}={int(v)}" if k in WHOLE_NUMBERS else f"{k}={v:.3f}"
                    for k, v in summary.items() if not k.endswith(("_low", "_high"))), flush=True)
                if summary["truncated"] > TRUNCATION_WARNING:
                    print(f"{name} [{mode}]: {summary['truncated']:.0%} of the responses hit --max-new-tokens "
                          f"{budget} unfinished, and a cut response scores 0: these accuracies are a "
                          "floor; give a larger --max-new-tokens", flush=True)
    if len(benchmarks) > 1:
        results["overall"] = {mode: overall(per, args.samples) for mode, per in by_mode.items()}
    if rewarder is not None:
        rewarder.close()
    (out_dir / "summary.json").write_text(json.dumps({"args": vars(args), "results": results,
                                                      "pool_twins_dropped": pool_twins,
                                                      "training_twins_dropped": training_twins}, indent=2))
    table = markdown_table(results)
    (out_dir / "summary.md").write_text(table)
    print(table)
    return results


if __name__ == "__main__":
    main()
