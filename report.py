"""What a run reports: a step's metrics per rollout kind and of the feedback channels (metrics.jsonl; the keys
are in docs/metrics.md), the progress bar's fields, and the end-of-run lines: truncation, what each feedback
channel did, the held-out gain, peak memory.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

import abstract
import config
import distributed
import pool as pool_lib
import stats
from config import Config
from pool import ExperiencePool


def kind_metrics(kinds: list[str], rewards: torch.Tensor, verdicts: torch.Tensor, lengths: torch.Tensor,
                 truncated: list[bool]) -> dict[str, float]:
    """Count, reward, accuracy (the math grader's verdicts), length and truncated share per rollout kind (kinds
    absent this step log only count 0): do feedback rollouts run longer?"""
    out = {}
    for kind in pool_lib.KINDS:
        idx = [i for i, k in enumerate(kinds) if k == kind]
        out[f"{kind}/count"] = float(len(idx))
        if idx:
            out[f"{kind}/reward"] = rewards[idx].mean().item()
            out[f"{kind}/accuracy"] = verdicts[idx].float().mean().item()
            out[f"{kind}/len"] = lengths[idx].mean().item()
            out[f"{kind}/truncated"] = float(np.mean([truncated[i] for i in idx]))
    return out


def feedback_metrics(local: abstract.AbstractionStats, pool: ExperiencePool, prompt_lens: list[int],
                     family: dict[str, str]) -> dict[str, float]:
    """Retrieval, relevance and abstraction statistics summed over the processes. The judge's score quantiles
    only when it scored candidates; against `family` (problem id -> family, synthetic:rules) the share of
    retrieved candidates from the problem's own family and the filter's precision and recall on them."""
    every = distributed.gather([local])
    a = abstract.AbstractionStats(**{
        f.name: (sum((getattr(x, f.name) for x in every), []) if isinstance(getattr(local, f.name), list)
                 else sum(getattr(x, f.name) for x in every)) for f in dataclasses.fields(abstract.AbstractionStats)})
    a.time_retrieval, a.time_relevance, a.time_abstraction = (local.time_retrieval, local.time_relevance,
                                                              local.time_abstraction)  # wall time of this process
    out = {
        "relevance_candidates": float(a.candidates),
        "relevance_accept_rate": a.kept / a.candidates if a.candidates else 0.0,
        "relevance_score_mean": float(np.mean(a.scores)) if a.scores else 0.0,
        "principles_made": float(a.made),
        "principles_cached": float(a.cached),
        "lessons_cached_empty": float(a.cached_empty),
        "principles_len_mean": float(np.mean(a.principles_tokens)) if a.principles_tokens else 0.0,
        "prompt_len_mean": float(np.mean(prompt_lens)),
        "pool_trials": float(len(pool)),
        "pool_problems": float(len(pool.trials)),
        "time_retrieval": a.time_retrieval,
        "time_relevance": a.time_relevance,
        "time_abstraction": a.time_abstraction,
    }
    if a.scores:
        for q in (10, 50, 90):
            out[f"relevance_score_p{q}"] = float(np.percentile(a.scores, q))
    if family and a.pairs:
        same = np.array([family.get(query) == family.get(candidate) for query, candidate in a.pairs])
        accepted = np.array(a.accepted, dtype=bool)
        out["relevance_family_share"] = float(same.mean())
        if accepted.any():
            out["relevance_precision"] = float(same[accepted].mean())
        if same.any():
            out["relevance_recall"] = float(accepted[same].mean())
    return out


def progress_fields(record: dict, cfg: Config) -> dict[str, str]:
    """The progress bar's fields: reward and length; each feedback kind on as count@reward this step (·
    when it made no rollout); the relevance filter's acceptance when it judged candidates."""
    fields = {"reward": f"{record['reward_mean']:.3f}", "len": f"{record['response_len_mean']:.0f}"}
    for kind, on in (("reflect", cfg.uses_reflection), ("abstract", cfg.uses_abstraction)):
        if on:
            n = int(record[f"{kind}/count"])
            fields[kind] = f"{n}@{record[f'{kind}/reward']:.2f}" if n else "·"
    if cfg.uses_abstraction and record["relevance_candidates"]:
        fields["relevant"] = f"{record['relevance_accept_rate']:.0%}"
    return fields


def truncation_summary(records: list[dict]) -> str:
    """One line: the share of each rollout kind's completions cut off at --max-new-tokens over the whole run
    (metrics.jsonl's records, weighted by each step's count)."""
    parts = []
    for kind in pool_lib.KINDS:
        counted = [(r[f"{kind}/count"], r[f"{kind}/truncated"]) for r in records if f"{kind}/truncated" in r]
        n = sum(c for c, _ in counted)
        if n:
            parts.append(f"{kind} {sum(c * t for c, t in counted) / n:.0%} of {int(n)}")
    return "truncated at --max-new-tokens: " + ", ".join(parts)


def feedback_summary(records: list[dict], cfg: Config) -> list[str]:
    """What each feedback channel did over the run (metrics.jsonl's records): its rollouts and their reward
    against the from-scratch rollouts of the steps both ran, with a line of its own when a channel never fired
    (and why) or scored below scratch; the relevance filter's acceptance and scores."""
    lines = []
    if cfg.uses_abstraction and cfg.wants_lessons:
        candidates = sum(r["relevance_candidates"] for r in records)
        kept = sum(r["relevance_candidates"] * r["relevance_accept_rate"] for r in records)
        scored = [r for r in records if "relevance_score_p50" in r]
        scores = (f" (median score {np.mean([r['relevance_score_p50'] for r in scored]):.2f}, per-step 10-90 % "
                  f"from {min(r['relevance_score_p10'] for r in scored):.2f} to "
                  f"{max(r['relevance_score_p90'] for r in scored):.2f})" if scored else "")
        family = (f"; {np.mean([r['relevance_family_share'] for r in records if 'relevance_family_share' in r]):.0%}"
                  " of the candidates were of the problem's family" if any("relevance_family_share" in r
                                                                          for r in records) else "")
        lines.append(f"relevance: {kept:.0f} of {candidates:.0f} candidates accepted at gamma "
                     f"{cfg.relevance_threshold}{scores}{family}; principles made "
                     f"{sum(r['principles_made'] for r in records):.0f}, served from the cache "
                     f"{sum(r['principles_cached'] for r in records):.0f}")
    for kind, on in (("reflect", cfg.uses_reflection), ("abstract", cfg.uses_abstraction and cfg.wants_lessons)):
        if not on or cfg.feedback_ratio == 0:
            continue
        count = sum(r[f"{kind}/count"] for r in records)
        if not count:
            slots = config.feedback_slots(cfg.group_size, cfg.feedback_ratio)
            made = sum(r["principles_made"] + r["principles_cached"] for r in records)
            why = ("no problem was drawn twice" if kind == "reflect" else
                   "the pool had no similar problem" if not sum(r["relevance_candidates"] for r in records) else
                   f"the relevance judge accepted no candidate at gamma {cfg.relevance_threshold}" if not made else
                   f"a group's {slots} feedback rollout goes to reflection first: raise --group-size or "
                   "--feedback-ratio" if cfg.uses_reflection and slots < 2 else
                   "its principles were made too late for a rollout (the run's last step)")
            lines.append(f"{kind}: never fired in {len(records)} steps: {why} (bench/context_probe.py says whether "
                         "this model can use the channel)")
            continue
        both = [r for r in records if r[f"{kind}/count"] and r["scratch/count"]]

        def mean_reward(name: str) -> float:  # over the steps both ran, weighted by each step's count
            return (sum(r[f"{name}/count"] * r[f"{name}/reward"] for r in both)
                    / max(1, sum(r[f"{name}/count"] for r in both)))

        mine, scratch = mean_reward(kind), mean_reward("scratch")
        below = ": below scratch" if mine < scratch else ""
        lines.append(f"{kind}: {count:.0f} rollouts, reward {mine:.3f} against {scratch:.3f} from scratch on the "
                     f"{len(both)} steps both ran{below}")
    return lines


def heldout_gain(out_dir: Path) -> str:
    """One line: held-out accuracy at the run's first and last evaluation, each with its 95 % interval, and
    the gain, paired on the same problems (bootstrap interval, p-value); empty with fewer than two evals."""
    path = out_dir / "heldout.jsonl"
    evals = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if len(evals) < 2:
        return ""
    first, last = evals[0], evals[-1]
    gain = stats.paired_difference([last["verdicts"]], [first["verdicts"]])
    return (f"held-out accuracy ({len(first['ids'])} problems, greedy, no feedback): step {first['step']} "
            f"{stats.fmt(*stats.interval([first['verdicts']]))} -> step {last['step']} "
            f"{stats.fmt(*stats.interval([last['verdicts']]))}; gain {stats.fmt_diff(gain)} (paired, "
            f"p {gain['p']:.3f}; 95 % intervals)")


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak so far: CUDA memory allocated by tensors on a GPU, resident set size on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
