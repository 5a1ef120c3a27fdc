"""Can this model use language feedback at all? Run it before a GPU run. Greedy accuracy on the same held-out
problems under each context, paired against no context:

    none                   the plain prompt (what training's held-out evaluation scores)
    reflect                reflection on the model's own (greedy, from-scratch) attempt, as training builds it
    principles             principles the model writes from K relevant pool trials (its own principles request)
    principles-irrelevant  the same from K trials of unrelated problems, each matched in length to one above
    raw                    the K relevant trials themselves (--abstract-mode raw's prompt)
    gold                   the gold answer stated (the ceiling of any context)

Relevant trials are those of the problem's family (synthetic:rules: its hidden rule; synthetic:arith: its
operations), most similar first; for data files without families, the retriever's top K. Each shown trial is
a problem's best (its newest correct one, else its newest), as abstraction shows it. The pool is the model's
own attempts at the training problems (`--pool sampled`), written-out gold solutions (`--pool gold`: what a
perfect pool would show), or a run's pool.jsonl. With families it also reports the relevance judge against
them: of the K candidates training retrieves per problem, the share of the problem's family, and the
precision and recall of the judge at --relevance-threshold (gamma), with its score quantiles.

    python bench/context_probe.py --dataset synthetic:rules --levels 1-2
    python bench/context_probe.py --model qwen2.5-coder-1.5b --dtype bf16 --dataset synthetic:rules --levels 1-2
    python bench/context_probe.py --model runs/default --pool runs/default/checkpoints/step-000010/pool.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import abstract  # noqa: E402
import config  # noqa: E402
import cpu  # noqa: E402
import data  # noqa: E402
import math_grader  # noqa: E402
import models  # noqa: E402
import prompts  # noqa: E402
import reflect  # noqa: E402
import stats  # noqa: E402
from pool import ExperiencePool, Trial  # noqa: E402
from rollout import generate_completions  # noqa: E402

CONTEXTS = ("none", "reflect", "principles", "principles-irrelevant", "raw", "gold")
SETTINGS = ("model", "dtype", "seed", "dataset", "data_dir", "split", "levels", "synthetic_size", "train_size",
            "id_field", "problem_field", "answer_field", "skip_bad_rows", "eval_dataset", "eval_split", "eval_size",
            "one_shot", "max_new_tokens", "attempt_tokens", "abstract_candidates", "abstract_from",
            "relevance_threshold", "abstract_max_tokens", "gen_batch", "share_prefill", "cpu_rows_first_matmul",
            "relevance_question")


def family_of(row: dict) -> str | None:
    """A problem's family: synthetic:rules' rule name (and its variants'), synthetic:arith's operations ('+', '* +',
    ...), else None."""
    if "family" in row:
        return row["family"]
    if "content" in row:
        return " ".join(t for t in row["content"].split() if not t.isdigit())
    return None


def make_pool(kind: str, model, tokenizer, rows: list[dict], cfg, eos_ids: list[int], samples: int) -> ExperiencePool:
    """The experiences: `gold` (one correct solution a training problem: the row's worked `solution` where it
    has one, as synthetic:rules' show their rule applied, else the answer alone), `sampled` (the model's own
    `samples` attempts a problem at temperature 1, graded), or a pool.jsonl."""
    pool = ExperiencePool(max_per_problem=max(8, samples))
    if kind == "gold":
        solutions = [r.get("solution", f"The answer is \\boxed{{{r['answer']}}}.") for r in rows]
        pool.add([Trial(r["id"], r["problem"], "scratch", "", text, 1.0, 1, data.content_key(r))
                  for r, text in zip(rows, solutions)])
    elif kind == "sampled":
        texts = [prompts.render_prompt(tokenizer, prompts.problem_request(r["problem"]), cfg.one_shot) for r in rows]
        outs = generate_completions(model, tokenizer, [t for t in texts for _ in range(samples)], eos_ids=eos_ids,
                                    max_new_tokens=cfg.max_new_tokens, temperature=1.0, batch_size=cfg.gen_batch,
                                    share_prefill=cfg.share_prefill, progress="pool: attempts at training problems")
        pool.add([Trial(r["id"], r["problem"], "scratch", "", o.text,
                        math_grader.grade(o.text, r["answer"], truncated=o.truncated), 1, data.content_key(r))
                  for i, r in enumerate(rows) for o in outs[i * samples:(i + 1) * samples]])
    else:
        pool.load(kind)
    return pool


def shown_trials(pool: ExperiencePool, tokenizer, attempt_tokens: int) -> dict[str, Trial]:
    """Each pool problem's trial as abstraction shows it: its best (newest correct, else newest), the response
    shortened to --attempt-tokens as training does. Made once; every context and the judge read it."""
    return {pid: dataclasses.replace(t, response=reflect.shorten(t.response, tokenizer, attempt_tokens))
            for pid, t in ((pid, abstract.best_trial(trials)) for pid, trials in pool.trials.items())}


def pick_experiences(row: dict, pool: ExperiencePool, shown: dict[str, Trial], family: dict[str, str | None],
                     k: int, solved: bool = False) -> tuple[list[Trial], list[Trial]]:
    """(relevant, irrelevant) trials for one held-out problem, as `shown`: K of its family (the retriever's top
    K when there are no families), most similar first, and for each one an unrelated problem's trial of the
    nearest length (problem and shown response, in characters), none used twice. solved (--abstract-from
    solved): both drawn only from problems with a correct trial, as training retrieves then."""
    ranked = [shown[trials[0].problem_id] for _, trials in pool.similar(row["problem"], len(pool.trials),
                                                                        row["id"], data.content_key(row), solved)]
    own = family_of(row)
    if own is None:
        relevant, others = ranked[:k], ranked[len(ranked) // 2:]  # unrelated: the less similar half
    else:
        relevant = [t for t in ranked if family[t.problem_id] == own][:k]
        others = [t for t in ranked if family[t.problem_id] != own]
    irrelevant = []
    for t in relevant:
        if not others:
            break
        size = len(t.problem) + len(t.response)
        nearest = min(others, key=lambda o: abs(len(o.problem) + len(o.response) - size))
        others.remove(nearest)
        irrelevant.append(nearest)
    return relevant, irrelevant


def write_principles(model, tokenizer, problems: list[str], shown: list[list[Trial]], cfg,
                     eos_ids: list[int]) -> list[str]:
    """The model's principles for each problem from its shown trials (greedy, cleaned as training cleans them);
    "" where nothing is shown."""
    todo = [i for i, trials in enumerate(shown) if trials]
    requests = [prompts.render_prompt(tokenizer, prompts.principles_request(problems[i], shown[i]), one_shot=False)
                for i in todo]
    outs = generate_completions(model, tokenizer, requests, eos_ids=eos_ids, max_new_tokens=cfg.abstract_max_tokens,
                                greedy=True, batch_size=cfg.gen_batch, share_prefill=cfg.share_prefill,
                                progress="principles") if requests else []
    made = [""] * len(problems)
    for i, out in zip(todo, outs):
        made[i] = abstract.clean_principles(out.text, [math_grader.extract_answer(t.response) for t in shown[i]])
    return made


def judge_report(model, tokenizer, rows: list[dict], pool: ExperiencePool, shown: dict[str, Trial],
                 family: dict[str, str | None], cfg) -> dict:
    """The relevance judge (asked --relevance-question) on the K candidates training would retrieve for each
    held-out problem, against the families, reading each candidate's problem and solution (experience, the
    default) and its problem alone: share of the problem's family among them, acceptance, precision and recall at
    gamma, score quantiles, the AUC (P(a same-family pair outscores an other-family one)), and the top-1
    precision (`--relevance-top 1`: the share of problems whose best-scored candidate is of their family, among
    the problems that have one)."""
    pairs, same, owner = {"experience": [], "problem": []}, [], []
    for i, row in enumerate(rows):
        for _, trials in pool.similar(row["problem"], cfg.abstract_candidates, row["id"], data.content_key(row),
                                      solved=cfg.abstract_from == "solved"):
            t = shown[trials[0].problem_id]
            pairs["experience"].append(prompts.relevance_request(row["problem"], t.problem, t.response,
                                                                 cfg.relevance_question))
            pairs["problem"].append(prompts.relevance_request(row["problem"], t.problem, None, cfg.relevance_question))
            same.append(family[t.problem_id] == family_of(row))
            owner.append(i)
    same, owner = np.array(same, dtype=bool), np.array(owner)
    has_family = [i for i in range(len(rows)) if same[owner == i].any()]
    out = {"candidates": int(same.size), "same_family_share": float(same.mean()), "gamma": cfg.relevance_threshold,
           "question": cfg.relevance_question, "problems_with_a_family_candidate": len(has_family)}
    for text, requests in pairs.items():
        scores = np.array(abstract.relevance_scores(model, tokenizer, requests))
        accepted = scores >= cfg.relevance_threshold
        best = [np.flatnonzero(owner == i)[np.argmax(scores[owner == i])] for i in has_family]
        out[text] = {
            "auc": float(np.mean([(a > b) + 0.5 * (a == b) for a in scores[same] for b in scores[~same]]))
            if same.any() and (~same).any() else float("nan"),
            "top1_precision": float(same[best].mean()) if best else float("nan"),
            "accepted": float(accepted.mean()),
            "precision": float(same[accepted].mean()) if accepted.any() else float("nan"),
            "recall": float(accepted[same].mean()) if same.any() else float("nan"),
            "score_quantiles": {name: [round(float(q), 3) for q in np.quantile(part, [0.1, 0.5, 0.9])]
                                if part.size else [] for name, part in (("same_family", scores[same]),
                                                                        ("other_family", scores[~same]))}}
    return out


def context_prompts(tokenizer, rows: list[dict], none: list[str], first: list[str], relevant: list[list[Trial]],
                    principles: dict[str, list[str]], cfg) -> dict[str, list[str | None]]:
    """Each context's prompt per held-out problem (None: the context has nothing for that problem); `none` are
    the plain prompts, `first` the responses to them."""
    def render(request: str) -> str:
        return prompts.render_prompt(tokenizer, request, cfg.one_shot)

    out = {"none": none,
           "reflect": [reflect.reflection_prompt(tokenizer, r["problem"], [attempt], attempt_tokens=cfg.attempt_tokens,
                                                 one_shot=cfg.one_shot)[0] for r, attempt in zip(rows, first)],
           "gold": [render(prompts.answer_hint_request(r["problem"], r["answer"])) for r in rows],
           "raw": [render(prompts.abstraction_request(r["problem"], prompts.raw_experience_block(k), raw=True))
                   if k else None for r, k in zip(rows, relevant)]}
    for name, made in principles.items():
        out[name] = [render(prompts.abstraction_request(r["problem"], text)) if text else None
                     for r, text in zip(rows, made)]
    return {name: out[name] for name in CONTEXTS}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    config.add_flags(ap, list(SETTINGS))
    ap.add_argument("--pool", default="sampled", help="sampled (the model's attempts at the training problems), "
                    "gold (written-out correct solutions), or a pool.jsonl")
    ap.add_argument("--pool-samples", type=int, default=4, help="attempts per training problem for --pool sampled")
    ap.add_argument("--out", default="", help="JSON with every verdict (default runs/bench/context_probe-*.json)")
    ap.add_argument("--judge-only", action="store_true", help="only the relevance judge's report (data with families)")
    args = ap.parse_args(argv)
    cfg = config.Config(**{name: getattr(args, name) for name in SETTINGS})
    config.check_config(cfg)
    if args.pool not in ("sampled", "gold") and not Path(args.pool).is_file():
        raise SystemExit(f"--pool {args.pool}: not 'sampled', 'gold' or a pool.jsonl file")
    if args.pool_samples < 1:
        raise SystemExit(f"--pool-samples must be >= 1, got {args.pool_samples}")
    train_rows, eval_rows, _ = data.load_rows(dataclasses.replace(cfg, eval_every=1))
    if not eval_rows:
        raise SystemExit(f"--dataset {cfg.dataset} has no held-out problems here: give --eval-dataset")
    family = {r["id"]: family_of(r) for r in train_rows + eval_rows}
    models.check_available(cfg.model)

    t_start = time.perf_counter()
    precision, why = config.resolve_dtype(cfg.dtype, torch.cuda.is_available(), cpu.native_bf16(), sharded=False)
    if why:
        print(why)
    tokenizer = models.load_tokenizer(cfg.model)
    model = models.load_for_inference(cfg.model, precision, cfg.cpu_rows_first_matmul, cfg.cpu_host_memory).eval()
    eos_ids = models.eos_token_ids(model, tokenizer)
    torch.manual_seed(cfg.seed)
    pool = make_pool(args.pool, model, tokenizer, train_rows, cfg, eos_ids, args.pool_samples)
    family.update({pid: family.get(pid) for pid in pool.trials})  # a saved pool's problems may be other rows
    if args.judge_only:
        if not any(family_of(r) is not None for r in eval_rows):
            raise SystemExit(f"--judge-only: {cfg.dataset} has no families to judge against (synthetic:rules and "
                             "its variants have)")
        judge = judge_report(model, tokenizer, eval_rows, pool, shown_trials(pool, tokenizer, cfg.attempt_tokens),
                             family, cfg)
        print(f"{cfg.model} on {cfg.dataset}: relevance judge, {judge['candidates']} retrieved candidates "
              f"({cfg.abstract_candidates} a problem), {judge['same_family_share']:.0%} of the problem's family")
        print_judge(judge)
        out = Path(args.out or f"runs/bench/judge-{Path(cfg.model).name}-{cfg.relevance_question}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(judge, indent=1))
        return {"judge": judge}

    def greedy(texts: list[str], label: str):
        return generate_completions(model, tokenizer, texts, eos_ids=eos_ids, max_new_tokens=cfg.max_new_tokens,
                                    greedy=True, batch_size=cfg.gen_batch, share_prefill=cfg.share_prefill,
                                    progress=label)

    none = [prompts.render_prompt(tokenizer, prompts.problem_request(r["problem"]), cfg.one_shot) for r in eval_rows]
    first_outs = greedy(none, "context none")
    first = [o.text for o in first_outs]
    shown = shown_trials(pool, tokenizer, cfg.attempt_tokens)
    picked = [pick_experiences(r, pool, shown, family, cfg.abstract_candidates, cfg.abstract_from == "solved")
              for r in eval_rows]
    relevant, irrelevant = [p[0] for p in picked], [p[1] for p in picked]
    problems = [r["problem"] for r in eval_rows]
    principles = {"principles": write_principles(model, tokenizer, problems, relevant, cfg, eos_ids),
                  "principles-irrelevant": write_principles(model, tokenizer, problems, irrelevant, cfg, eos_ids)}
    texts = context_prompts(tokenizer, eval_rows, none, first, relevant, principles, cfg)
    results = {}
    for name, per_row in texts.items():
        given = [i for i, t in enumerate(per_row) if t is not None]
        outs = first_outs if name == "none" else greedy([per_row[i] for i in given], f"context {name}")
        verdicts = [0.0] * len(eval_rows)  # a problem the context has nothing for counts as wrong under it
        responses = [""] * len(eval_rows)
        for i, out in zip(given, outs):
            verdicts[i] = math_grader.grade(out.text, eval_rows[i]["answer"], truncated=out.truncated)
            responses[i] = out.text
        results[name] = {"with_context": len(given), "verdicts": verdicts, "truncated": [o.truncated for o in outs],
                         "responses": responses,
                         "prompt_tokens": float(np.mean([len(tokenizer(per_row[i], add_special_tokens=False)
                                                              .input_ids) for i in given])) if given else 0.0}
    return report(args, cfg, eval_rows, pool, shown, relevant, family, results, principles, model, tokenizer,
                  t_start)


def print_judge(j: dict) -> None:
    for text in ("experience", "problem"):
        q = j[text]["score_quantiles"]
        print(f"  --relevance-question {j['question']} --relevance-text {text}: AUC {j[text]['auc']:.3f}, top-1 "
              f"precision {j[text]['top1_precision']:.2f} (of the {j['problems_with_a_family_candidate']} problems "
              f"with a candidate of their family); {j[text]['accepted']:.0%} accepted, precision "
              f"{j[text]['precision']:.2f}, recall {j[text]['recall']:.2f}; scores 10/50/90 %: same family "
              f"{q['same_family']}, other {q['other_family']}")


def report(args, cfg, rows, pool, shown, relevant, family, results, principles, model, tokenizer, t_start) -> dict:
    """The table (stdout) and the JSON (every verdict and response, the principles written, the pool's make-up,
    the judge's report)."""
    base = results["none"]["verdicts"]
    shown_correct = [t.reward > 0 for trials in relevant for t in trials]
    summary = {"model": cfg.model, "dataset": cfg.dataset, "levels": cfg.levels, "seed": cfg.seed,
               "problems": len(rows), "pool": args.pool, "pool_trials": len(pool),
               "pool_correct": float(np.mean([t.reward > 0 for ts in pool.trials.values() for t in ts])),
               "relevant_shown_correct": float(np.mean(shown_correct)) if shown_correct else float("nan"),
               "contexts": {}}
    for name, r in results.items():
        mean, low, high = stats.interval([r["verdicts"]])
        row = {"accuracy": [mean, low, high], "with_context": r["with_context"], "prompt_tokens": r["prompt_tokens"],
               "truncated": float(np.mean(r["truncated"])) if r["truncated"] else None}
        if name != "none":
            row["vs_none"] = stats.paired_difference([r["verdicts"]], [base])
        summary["contexts"][name] = row
    if any(family_of(r) is not None for r in rows):
        summary["judge"] = judge_report(model, tokenizer, rows, pool, shown, family, cfg)
    summary["seconds"] = time.perf_counter() - t_start
    print(f"\n{cfg.model} on {cfg.dataset} (levels {cfg.levels}, seed {cfg.seed}): {len(rows)} held-out problems, "
          f"greedy; pool {args.pool}: {len(pool)} trials, {summary['pool_correct']:.0%} correct; relevant trials "
          f"shown {summary['relevant_shown_correct']:.0%} correct")
    print("| context | problems with it | accuracy [95 %] | minus none [95 %] (paired p) | truncated | prompt tokens |")
    print("|---|---|---|---|---|---|")
    for name, row in summary["contexts"].items():
        diff = f"{stats.fmt_diff(row['vs_none'])} (p {row['vs_none']['p']:.3f})" if "vs_none" in row else ""
        cut = f"{row['truncated']:.0%}" if row["truncated"] is not None else ""
        print(f"| {name} | {row['with_context']} | {stats.fmt(*row['accuracy'])} | {diff} | {cut} | "
              f"{row['prompt_tokens']:.0f} |")
    if "judge" in summary:
        j = summary["judge"]
        print(f"relevance judge, {j['candidates']} retrieved candidates ({cfg.abstract_candidates} a problem), "
              f"{j['same_family_share']:.0%} of the problem's family; at gamma {j['gamma']}:")
        print_judge(j)
    out = Path(args.out or f"runs/bench/context_probe-{Path(cfg.model).name}-{cfg.dataset.replace(':', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**summary, "ids": [r["id"] for r in rows],
                               "verdicts": {k: v["verdicts"] for k, v in results.items()},
                               "responses": {k: v["responses"] for k, v in results.items()},
                               "principles": principles}, indent=1))
    print(f"{summary['seconds']:.0f} s; every verdict in {out}")
    return summary


if __name__ == "__main__":
    main()
