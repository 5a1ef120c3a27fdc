"""Evaluation: accuracy of a model or checkpoint on math benchmarks, without feedback (zero-shot) or with
it at test time (reflect: a second turn that reviews the first attempt; abstract: principles from a saved
*training* pool). Training's periodic eval calls `evaluate_rows` too: one implementation.

    python evaluate.py --model runs/default/final --benchmarks gsm8k math500 --limit 50 --mode zero-shot reflect
    python evaluate.py --model Qwen2.5-7B --benchmarks math500 aime24 --samples 8 --temperature 0.6

Metrics per benchmark and overall: avg@k (mean accuracy of the k samples), unbiased pass@j (Chen et al.
2021) for j = 1, 2, 4, ... <= k, maj@k (majority vote over extracted answers; ties count fractionally),
mean response length, truncation rate. Every accuracy comes with its 95 % interval (bootstrap over
problems: `<metric>_low`, `<metric>_high` in summary.json, brackets in summary.md). Outputs: summary.json,
summary.md and problems.jsonl (prompt, responses, extracted answers, verdicts) under --out-dir.

    python evaluate.py --compare runs/eval/grpo runs/eval/lanpo   # paired bootstrap on the shared problems
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import abstract
import data
import math_grader
import models
import prompts
import reflect
import stats
from pool import ExperiencePool
from rollout import generate_completions

MODES = ("zero-shot", "reflect", "abstract")


# ------------------------------------------------------------------------------------------------ metrics

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), in a stable product form."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_correct(answers: list[str | None], verdicts: list[float]) -> float:
    """maj@k: the most frequent extracted answer (normalised) wins; responses without an answer do not
    vote. Ties count fractionally: the share of correct answers among the tied winners (the expected
    score of a uniformly random tie-break). No votes at all scores 0."""
    votes: Counter = Counter()
    verdict_of: dict[str, float] = {}
    for answer, verdict in zip(answers, verdicts):
        if answer is None:
            continue
        key = math_grader.normalize(answer)
        votes[key] += 1
        verdict_of.setdefault(key, verdict)
    if not votes:
        return 0.0
    top = max(votes.values())
    winners = [key for key, count in votes.items() if count == top]
    return sum(verdict_of[w] for w in winners) / len(winners)


def summarize(records: list[dict], samples: int) -> dict[str, float]:
    """Benchmark-level metrics from per-problem records (each with `verdicts`, `lengths`, `truncated`,
    `answers`); each accuracy with its 95 % bootstrap interval over problems (`_low`, `_high`)."""
    if not records:
        return {}
    out = {"problems": float(len(records))}
    for key, scores in per_problem_scores(records, samples).items():
        out[key], out[f"{key}_low"], out[f"{key}_high"] = stats.interval([scores])
    out["response_len"] = float(np.mean([np.mean(r["lengths"]) for r in records]))
    out["truncated"] = float(np.mean([np.mean(r["truncated"]) for r in records]))
    return out


def per_problem_scores(records: list[dict], samples: int) -> dict[str, list[float]]:
    """Each accuracy metric's score per problem (their means are the benchmark's metrics): avg@k, pass@j for
    j = 1, 2, 4, ... <= k, maj@k."""
    out = {f"avg@{samples}": [float(np.mean(r["verdicts"])) for r in records]}
    j = 1
    while j <= samples:
        out[f"pass@{j}"] = [pass_at_k(samples, int(sum(r["verdicts"])), j) for r in records]
        j *= 2
    out[f"maj@{samples}"] = [majority_correct(r["answers"], r["verdicts"]) for r in records]
    return out


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
    lines = [f"A = {a_dir}, B = {b_dir}: A - B [95 % interval] (paired bootstrap p-value)", "",
             "| benchmark | mode | problems | " + " | ".join(per_problem_scores([next(iter(a.values()))], samples))
             + " |", "|---|---|---|" + "---|" * len(per_problem_scores([next(iter(a.values()))], samples))]
    parts = sorted({(bench, mode) for bench, mode, _ in a})
    benches = {bench for bench, _ in parts}
    for bench, mode in parts + ([("overall", m) for m in sorted({m for _, m in parts})] if len(benches) > 1 else []):
        keys = [key for key in a if key[1] == mode and bench in ("overall", key[0])]
        sa = per_problem_scores([a[key] for key in keys], samples)
        sb = per_problem_scores([b[key] for key in keys], samples)
        cells = []
        for metric in sa:
            d = stats.paired_difference([sa[metric]], [sb[metric]])
            cells.append(f"{stats.fmt_diff(d)} (p {d['p']:.3f})")
        lines.append(f"| {bench} | {mode} | {len(keys)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ running

@dataclass
class EvalSettings:
    samples: int = 1            # k responses per problem
    temperature: float = 0.0    # 0 = greedy (then samples must be 1)
    top_p: float = 1.0
    max_new_tokens: int = 512
    one_shot: bool = True
    gen_batch: int = 64
    attempt_tokens: int = 512   # reflect/abstract: budget per shown attempt or experience
    inter_candidates: int = 3
    relevance_threshold: float = 0.9
    abstract_max_tokens: int = 256


def _sample(model, tokenizer, texts: list[str], s: EvalSettings, eos_ids: list[int]):
    return generate_completions(model, tokenizer, texts, eos_ids=eos_ids, max_new_tokens=s.max_new_tokens,
                                temperature=s.temperature or 1.0, top_p=s.top_p, greedy=s.temperature == 0,
                                batch_size=s.gen_batch)


def _record(row: dict, prompt: str, outs) -> dict:
    verdicts = [math_grader.grade(o.text, row["answer"]) for o in outs]
    return {"id": row["id"], "problem": row["problem"], "gold": row["answer"], "prompt": prompt,
            "responses": [o.text for o in outs], "answers": [math_grader.extract_answer(o.text) for o in outs],
            "verdicts": verdicts, "lengths": [len(o.completion_ids) for o in outs],
            "truncated": [o.truncated for o in outs]}


def evaluate_rows(model, tokenizer, rows: list[dict], mode: str, s: EvalSettings, eos_ids: list[int],
                  pool: ExperiencePool | None = None,
                  first_turn: list[dict] | None = None) -> tuple[list[dict], dict[str, float]]:
    """Per-problem records and the summary for one benchmark in one mode. In `reflect` mode each record
    also holds the second turn (`turn2_*`), and the summary the turn-2 metrics and the flips; turn 1 is
    a zero-shot pass, taken from `first_turn` (zero-shot records of the same rows and seed) when given."""
    if s.temperature == 0 and s.samples != 1:
        raise SystemExit("greedy decoding (--temperature 0) gives one distinct sample: use --samples 1")
    k = s.samples
    lessons: dict[str, str] = {}
    if mode == "abstract":
        if pool is None:
            raise SystemExit("--mode abstract needs --pool (a pool.jsonl saved by a training run)")
        lessons, _ = abstract.lessons_for(
            model, tokenizer, pool, rows, {}, 0, candidates=s.inter_candidates, gamma=s.relevance_threshold,
            mode="principles", refresh=1, attempt_tokens=s.attempt_tokens, max_new_tokens=s.abstract_max_tokens,
            eos_ids=eos_ids, gen_batch=s.gen_batch)
    texts = []
    for row in rows:
        request = prompts.problem_request(row["problem"])
        if row["id"] in lessons:
            request = prompts.abstraction_request(row["problem"], lessons[row["id"]])
        texts.append(prompts.render_prompt(tokenizer, request, s.one_shot))
    if mode == "reflect" and first_turn is not None:
        records = [dict(r) for r in first_turn]
    else:
        outs = _sample(model, tokenizer, [t for t in texts for _ in range(k)], s, eos_ids)
        records = [_record(row, text, outs[i * k:(i + 1) * k]) for i, (row, text) in enumerate(zip(rows, texts))]
    for r in records:
        r["lessons"] = lessons.get(r["id"], "")
    summary = summarize(records, k)
    if mode == "abstract":
        summary["with_lessons"] = float(len(lessons)) / len(rows)

    if mode == "reflect":  # turn 2: each sample reviews its own first attempt (never told if it was right)
        second = [reflect.reflection_prompt(tokenizer, r["problem"], [resp], attempt_tokens=s.attempt_tokens,
                                            one_shot=s.one_shot)[0] for r in records for resp in r["responses"]]
        outs2 = _sample(model, tokenizer, second, s, eos_ids)
        turn2 = [_record(row, "", outs2[i * k:(i + 1) * k]) for i, row in enumerate(rows)]
        for r, t in zip(records, turn2):
            for key in ("responses", "answers", "verdicts", "lengths", "truncated"):
                r[f"turn2_{key}"] = t[key]
        summary.update(turn2_summary(records, k))
    return records, summary


def turn2_summary(records: list[dict], samples: int) -> dict[str, float]:
    """Turn-2 metrics of reflect mode, and the share of samples that flipped right->wrong / wrong->right."""
    turn2 = [{k.removeprefix("turn2_"): v for k, v in r.items() if k.startswith("turn2_")} for r in records]
    out = {f"turn2_{key}": v for key, v in summarize(turn2, samples).items() if key != "problems"}
    pairs = [(b > 0, a > 0) for r in records for b, a in zip(r["verdicts"], r["turn2_verdicts"])]
    out["flip_right_to_wrong"] = sum(b and not a for b, a in pairs) / len(pairs)
    out["flip_wrong_to_right"] = sum(a and not b for b, a in pairs) / len(pairs)
    return out


# ------------------------------------------------------------------------------------------------ CLI

def load_benchmark(name: str, data_dir: Path, limit: int, seed: int, split: str) -> list[dict]:
    """Rows of a benchmark name (see data.BENCHMARKS), a data file (data.FILE_SUFFIXES), synthetic:arith, or
    hub:<dataset id>. --limit takes a seeded random subset, so repeated runs see the same problems."""
    if name in data.BENCHMARKS:
        rows, _ = data.load_problems(str(data.benchmark_path(name, data_dir)), split)
    elif name.startswith("hub:"):
        rows, _ = data.load_problems(name[4:], split)
    elif name.startswith("synthetic:") or Path(name).suffix in data.FILE_SUFFIXES:
        rows, _ = data.load_problems(name, "test" if name.startswith("synthetic:") else split, size=max(limit, 0))
    else:
        raise SystemExit(f"unknown benchmark {name!r}: use one of {sorted(data.BENCHMARKS)}, a "
                         f"{'/'.join(data.FILE_SUFFIXES)} path, synthetic:arith, or hub:<dataset>")
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
                elif k == "problems":
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
    out = summarize(records, samples)
    if records and "turn2_verdicts" in records[0]:
        out.update(turn2_summary(records, samples))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=models.EMBEDDED, help="hub id, alias, checkpoint dir (full or LoRA adapter)")
    ap.add_argument("--benchmarks", nargs="+", default=["gsm8k", "math500"],
                    help=f"names {sorted(data.BENCHMARKS)}, file paths, synthetic:arith or hub:<id>")
    ap.add_argument("--mode", nargs="+", default=["zero-shot"], choices=MODES, help="evaluation modes")
    ap.add_argument("--pool", default="", help="training pool.jsonl for --mode abstract (never test answers)")
    ap.add_argument("--data-dir", default=str(data.DATA_DIR), help="where benchmark names are looked up")
    ap.add_argument("--split", default="test", help="split of hub datasets")
    ap.add_argument("--limit", type=int, default=0, help="seeded random subset of N problems per benchmark (0 = all)")
    ap.add_argument("--seed", type=int, default=0, help="seed for the subset and for sampling")
    ap.add_argument("--samples", type=int, default=1, help="k: responses per problem")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="longest response")
    ap.add_argument("--one-shot", action=argparse.BooleanOptionalAction, default=True,
                    help="worked example turn before each problem (as in training)")
    ap.add_argument("--gen-batch", type=int, default=64, help="prompts per generate call")
    ap.add_argument("--attempt-tokens", type=int, default=512, help="budget per shown attempt/experience")
    ap.add_argument("--relevance-threshold", type=float, default=0.9, help="gamma for --mode abstract")
    ap.add_argument("--out-dir", default="runs/eval", help="summary.json, summary.md, problems.jsonl")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None,
                    help="instead of evaluating: A - B of two --out-dirs on the same problems (paired bootstrap)")
    args = ap.parse_args(argv)
    if args.compare:
        table = compare(*args.compare)
        print(table)
        return {"compare": table}

    settings = EvalSettings(samples=args.samples, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, one_shot=args.one_shot, gen_batch=args.gen_batch,
                            attempt_tokens=args.attempt_tokens, relevance_threshold=args.relevance_threshold)
    for flag, least in (("samples", 1), ("limit", 0), ("max_new_tokens", 1), ("gen_batch", 1), ("attempt_tokens", 1)):
        if getattr(args, flag) < least:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    out_dir = Path(args.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise SystemExit(f"--out-dir {out_dir} is a file, not a directory: choose another --out-dir")
    if (out_dir / "summary.json").exists() or (out_dir / "problems.jsonl").exists():
        raise SystemExit(f"{out_dir} already holds an evaluation: choose another --out-dir (nothing was changed)")
    if args.temperature == 0 and args.samples != 1:
        raise SystemExit("greedy decoding (--temperature 0) gives one distinct sample: use --samples 1")
    pool = None
    if "abstract" in args.mode:
        if not args.pool:
            raise SystemExit("--mode abstract needs --pool (a pool.jsonl saved by a training run)")
        pool = ExperiencePool()
        pool.load(args.pool)
    # every benchmark is loaded and checked before the model is
    benchmarks = {Path(name).name: load_benchmark(name, Path(args.data_dir), args.limit, args.seed, args.split)
                  for name in args.benchmarks}  # a file path is shown by its file name
    models.check_available(args.model)

    tokenizer = models.load_tokenizer(args.model)
    model = models.load_policy(args.model, torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    if torch.cuda.is_available():
        model = model.to("cuda")
    eos_ids = models.eos_token_ids(model, tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict[str, float]]] = {}
    args.mode = sorted(set(args.mode), key=MODES.index)  # zero-shot first: reflect reuses it as turn 1
    by_mode: dict[str, dict[str, tuple]] = {m: {} for m in args.mode}
    with open(out_dir / "problems.jsonl", "w", encoding="utf-8") as f:
        for name, rows in benchmarks.items():
            for mode in args.mode:
                torch.manual_seed(args.seed)
                t0 = time.perf_counter()
                zero_shot = by_mode.get("zero-shot", {}).get(name, (None,))[0]  # reflect's turn 1, already run
                records, summary = evaluate_rows(model, tokenizer, rows, mode, settings, eos_ids, pool, zero_shot)
                summary["seconds"] = time.perf_counter() - t0
                results.setdefault(name, {})[mode] = summary
                by_mode[mode][name] = (records, summary)
                for r in records:
                    f.write(json.dumps({"benchmark": name, "mode": mode, **r}, ensure_ascii=False) + "\n")
                print(f"{name} [{mode}]: " + ", ".join(
                    f"{k}={stats.fmt(v, summary[k + '_low'], summary[k + '_high']) if k + '_low' in summary else f'{v:.3f}'}"
                    for k, v in summary.items() if not k.endswith(("_low", "_high"))), flush=True)
    if len(benchmarks) > 1:
        results["overall"] = {mode: overall(per, args.samples) for mode, per in by_mode.items()}
    (out_dir / "summary.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    table = markdown_table(results)
    (out_dir / "summary.md").write_text(table)
    print(table)
    return results


if __name__ == "__main__":
    main()
