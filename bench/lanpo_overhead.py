"""LANPO overhead: step time with `--feedback both` against plain GRPO (`--feedback none`) at the same
B x G, on the embedded model, with few problems so that they recur and both kinds of feedback are used.
Breaks the extra time down into retrieval, relevance scoring, abstraction and longer prompts, and
estimates what the lessons cache saved (cached problems x mean cost of one distillation). Runs alternate
(GRPO, LANPO, GRPO, LANPO, ...) in fresh processes; the ratio is of the medians over every timed step.
Each arm runs lanpo.py through bench/work.py, which counts the FLOPs of every forward and backward by phase:
the ratio of work a step says how much of the time ratio no implementation could remove without changing
the method, and GFLOP/s per phase shows which phases run slowly for their work (decoding a few rows).
Also reports what the relevance judgement accepted, so that a speed flag that changes what the policy
sees (--relevance-text problem, --abstract-ahead) is measured for its effect, not only its speed.

The floor is a roofline: before the runs the bench measures this machine's fp32 matmul rate (peak compute) and
copy bandwidth (a large tensor copied, bytes read and written), and each phase's least time is the larger of
its FLOPs (padding left out) at the peak and the weights' bytes its forwards read at the bandwidth. Few-row
decoding (the principles, sampling) is bound by the bytes: every decoding step reads all the weights. The
floor ratio puts the difference of the two arms' least times on top of GRPO's measured step; the compute-only
floor of earlier versions is printed beside it.

    python bench/lanpo_overhead.py                   # 2 rounds x 6 steps each, B=4, G=4
    python bench/lanpo_overhead.py --steps 3 --rounds 1          # smoke run
    python bench/lanpo_overhead.py --max-new-tokens 128          # longer completions: prompts weigh less
    python bench/lanpo_overhead.py --both-flags="--no-share-prefill"      # the profile before prefill sharing
    python bench/lanpo_overhead.py --lanpo-flags="--abstract-ahead --relevance-text problem"
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402

import stats  # noqa: E402


def run(out: Path, feedback: str, args, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "bench" / "work.py"), "--feedback", feedback, "--steps", str(args.steps),
           "--batch-problems", str(args.batch_problems), "--group-size", str(args.group_size),
           "--micro-batch", str(args.batch_problems * args.group_size // 2), "--synthetic-size",
           str(2 * args.batch_problems), "--max-new-tokens", str(args.max_new_tokens), "--abstract-max-tokens", "48",
           "--relevance-threshold", str(args.gamma), "--abstract-refresh", "2", "--eval-every", "0",
           "--report-to", "none", "--no-final-checkpoint", "--out-dir", str(out), *shlex.split(args.both_flags), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[1:4])} ... failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out)  # final/ holds the weights: 0.5 GB a run
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-problems", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--gamma", type=float, default=0.5,
                    help="relevance threshold (SmolLM2-135M scores 0.33-0.61: 0.9 would make no principles)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating (GRPO, LANPO) pairs of runs")
    ap.add_argument("--max-new-tokens", type=int, default=32,
                    help="longest completion (longer ones weigh the prompts, where LANPO differs, less)")
    ap.add_argument("--both-flags", default="", help="extra lanpo.py flags for both arms")
    ap.add_argument("--lanpo-flags", default="", help="extra lanpo.py flags for the LANPO arm only")
    ap.add_argument("--out", default="runs/bench/lanpo_overhead.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lanpo_overhead_"))
    peaks = common.machine_peaks()
    grpo, lanpo = [], []
    for r in range(args.rounds):
        grpo += run(work / f"grpo-{r}", "none", args, [])
        lanpo += run(work / f"lanpo-{r}", "both", args, shlex.split(args.lanpo_flags))
    # step 1 of every run is warm-up (and has no feedback)
    timed = lambda rs, k: [r.get(k, 0.0) for r in rs if r["step"] > 1]  # noqa: E731
    made = sum(r["principles_made"] for r in lanpo)
    per_distillation = sum(r["time_abstraction"] for r in lanpo) / made if made else 0.0
    parts = ("time_retrieval", "time_relevance", "time_abstraction", "time_generate", "time_update")
    result = {
        "mean_s": {arm: {k: float(np.mean(timed(rs, k))) for k in parts} for arm, rs in (("grpo", grpo),
                                                                                       ("lanpo", lanpo))},
        "steps": {"grpo": grpo, "lanpo": lanpo},  # every run's metrics, in run order
        "grpo_step_s": float(np.median(timed(grpo, "time_step"))),
        "lanpo_step_s": float(np.median(timed(lanpo, "time_step"))),
        "breakdown_mean_s": {k: float(np.mean(timed(lanpo, k))) - float(np.mean(timed(grpo, k)))
                             for k in parts},
        "prompt_tokens": {"grpo": float(np.mean(timed(grpo, "prompt_len_mean"))),
                          "lanpo": float(np.mean(timed(lanpo, "prompt_len_mean")))},
        "rollouts_by_kind": {k: sum(r[f"{k}/count"] for r in lanpo) for k in ("scratch", "reflect", "abstract")},
        "principles_made": made, "principles_cached": sum(r["principles_cached"] for r in lanpo),
        "relevance_candidates": sum(r["relevance_candidates"] for r in lanpo),
        "relevance_kept": sum(r["relevance_candidates"] * r["relevance_accept_rate"] for r in lanpo),
        "abstract_reward": float(np.mean([r["abstract/reward"] for r in lanpo if r.get("abstract/count")] or [0])),
        "flags": {"both": args.both_flags, "lanpo": args.lanpo_flags}, "rounds": args.rounds,
        "cache_saved_s_estimate": sum(r["principles_cached"] for r in lanpo) * per_distillation / max(1, len(lanpo)),
    }
    # work (bench/work.py): GFLOP a step by phase, each phase against the seconds it is timed in
    phases = {"sampling": ("time_generate",), "principles": ("time_abstraction",), "relevance": ("time_relevance",),
              "retrieval": ("time_retrieval",), "update": ("time_logprob", "time_update")}
    arms = (("grpo", grpo), ("lanpo", lanpo))
    total = lambda rs: [sum(r[k] for k in r if k.startswith("work/") and k.endswith("_gflop")  # noqa: E731
                            and not k.endswith("_padding_gflop")) for r in rs if r["step"] > 1]
    useful = lambda rs: [t - sum(r[k] for k in r if k.endswith("_padding_gflop"))  # noqa: E731
                         for t, r in zip(total(rs), [r for r in rs if r["step"] > 1])]
    result["work_gflop"] = {arm: {p: float(np.mean(timed(rs, f"work/{p}_gflop"))) for p in phases} for arm, rs in arms}
    result["work_s"] = {arm: {p: float(np.sum([np.mean(timed(rs, k)) for k in keys])) for p, keys in phases.items()}
                        for arm, rs in arms}
    result["padding_gflop"] = {arm: {p: float(np.mean(timed(rs, f"work/{p}_padding_gflop"))) for p in phases}
                               for arm, rs in arms}
    result["update_padding_gflop_prompts"] = {arm: float(np.mean(timed(rs, "work/update_padding_gflop_prompts")))
                                              for arm, rs in arms}
    result["work_ratio"] = float(np.median(total(lanpo)) / np.median(total(grpo)))
    result["work_ratio_95"] = stats.median_ratio_interval(total(lanpo), total(grpo))
    result["useful_work_ratio"] = float(np.median(useful(lanpo)) / np.median(useful(grpo)))
    result["useful_work_ratio_95"] = stats.median_ratio_interval(useful(lanpo), useful(grpo))
    # the floor: LANPO's extra work (padding left out) run at the fastest rate any phase reached here, on top
    # of GRPO's step as it is. No implementation of the same method beats it on this machine without making
    # GRPO's own step slower; a faster GRPO raises it.
    result["peak_gflop_s"] = max(result["work_gflop"][arm][p] / result["work_s"][arm][p] for arm in ("grpo", "lanpo")
                                 for p in phases if result["work_s"][arm][p] > 0)
    extra = float(np.median(useful(lanpo)) - np.median(useful(grpo)))
    result["ratio_floor_compute"] = 1 + extra / result["peak_gflop_s"] / result["grpo_step_s"]
    # the roofline: per phase, FLOPs (padding left out) at the measured peak or weight bytes at the measured
    # bandwidth, whichever takes longer; the peak is the matmul's or a phase's, whichever was faster
    result["machine"] = {**peaks, "peak_gflop_s": max(peaks["peak_gflop_s"], result["peak_gflop_s"])}
    result["weight_gb"] = {arm: {p: float(np.mean(timed(rs, f"work/{p}_weight_gb"))) for p in phases}
                           for arm, rs in arms}
    result["roofline_s"] = {arm: {p: common.roofline_s(result["work_gflop"][arm][p] - result["padding_gflop"][arm][p],
                                                       result["weight_gb"][arm][p], result["machine"]) for p in phases}
                            for arm, _ in arms}
    least = {arm: sum(result["roofline_s"][arm].values()) for arm, _ in arms}
    result["ratio_floor"] = 1 + (least["lanpo"] - least["grpo"]) / result["grpo_step_s"]
    result["ratio"] = result["lanpo_step_s"] / result["grpo_step_s"]
    result["ratio_95"] = stats.median_ratio_interval(timed(lanpo, "time_step"), timed(grpo, "time_step"))
    print(f"B={args.batch_problems} G={args.group_size}, {args.max_new_tokens} new tokens, {args.rounds} rounds x "
          f"{args.steps} steps each (step 1 not counted); flags both: {args.both_flags or '-'}, "
          f"LANPO: {args.lanpo_flags or '-'}")
    print(f"median step: GRPO {result['grpo_step_s']:.1f} s, LANPO {result['lanpo_step_s']:.1f} s, "
          f"ratio {result['ratio']:.2f} (95 % bootstrap interval over steps {result['ratio_95'][0]:.2f}-"
          f"{result['ratio_95'][1]:.2f})")
    print("seconds per step (mean): GRPO, LANPO, LANPO - GRPO")
    for k, v in result["breakdown_mean_s"].items():
        print(f"  {k:17s} {result['mean_s']['grpo'][k]:6.2f} {result['mean_s']['lanpo'][k]:6.2f} {v:+.2f}")
    print(f"work a step (median GFLOP): GRPO {np.median(total(grpo)):.0f}, LANPO {np.median(total(lanpo)):.0f}, "
          f"ratio {result['work_ratio']:.2f} ({result['work_ratio_95'][0]:.2f}-{result['work_ratio_95'][1]:.2f})")
    print(f"without padding: GRPO {np.median(useful(grpo)):.0f}, LANPO {np.median(useful(lanpo)):.0f}, ratio "
          f"{result['useful_work_ratio']:.2f} ({result['useful_work_ratio_95'][0]:.2f}-"
          f"{result['useful_work_ratio_95'][1]:.2f})")
    m = result["machine"]
    print(f"machine: {m['peak_gflop_s']:.0f} GFLOP/s fp32 peak, {m['bandwidth_gb_s']:.1f} GB/s copy bandwidth")
    print(f"floor (roofline): LANPO's least time over GRPO's, on top of GRPO's step: ratio at least "
          f"{result['ratio_floor']:.2f}; LANPO's measured ratio is {result['ratio'] / result['ratio_floor']:.2f}x "
          f"that floor (compute only, as before: {result['ratio_floor_compute']:.2f})")
    print("least seconds a step by phase (roofline: FLOPs at the peak or weight bytes at the bandwidth) and the "
          "measured seconds: GRPO, LANPO")
    for p in phases:
        cells = []
        for arm in ("grpo", "lanpo"):
            useful_gflop = result["work_gflop"][arm][p] - result["padding_gflop"][arm][p]
            bound = "bytes" if result["weight_gb"][arm][p] / m["bandwidth_gb_s"] > useful_gflop / m["peak_gflop_s"] \
                else "flops"
            cells.append(f"{result['roofline_s'][arm][p]:5.2f} ({bound}) vs {result['work_s'][arm][p]:5.2f}")
        print(f"  {p:11s} " + "   ".join(cells))
    print("GFLOP a step (mean; of it padding) and GFLOP/s: GRPO, LANPO")
    for p in phases:
        g, lw = result["work_gflop"]["grpo"][p], result["work_gflop"]["lanpo"][p]
        gp, lp = result["padding_gflop"]["grpo"][p], result["padding_gflop"]["lanpo"][p]
        gs, ls = result["work_s"]["grpo"][p], result["work_s"]["lanpo"][p]
        rate = lambda w, s: f"{w / s:6.0f}" if s > 0 and w > 0 else "     -"  # noqa: E731
        print(f"  {p:11s} {g:6.0f} ({gp:4.0f}) {lw:6.0f} ({lp:4.0f})   {rate(g, gs)} {rate(lw, ls)}")
    print(f"  of the update's padding, distinct prompts padded to the longest of their range in forward (2) of "
          f"the prefix tree: "
          f"GRPO {result['update_padding_gflop_prompts']['grpo']:.0f}, "
          f"LANPO {result['update_padding_gflop_prompts']['lanpo']:.0f}")
    print(f"prompt tokens per rollout: GRPO {result['prompt_tokens']['grpo']:.0f}, "
          f"LANPO {result['prompt_tokens']['lanpo']:.0f}")
    print(f"rollouts by kind: {result['rollouts_by_kind']}; principles made {made:.0f}, served from cache "
          f"{result['principles_cached']:.0f} (saved ~{result['cache_saved_s_estimate']:.1f} s per step)")
    print(f"relevance: kept {result['relevance_kept']:.0f} of {result['relevance_candidates']} candidates judged; "
          f"abstraction rollouts' mean reward {result['abstract_reward']:.3f}")
    common.save_json(result, args.out)


if __name__ == "__main__":
    main()
