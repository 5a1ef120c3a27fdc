"""The update's forwards in groups of similar completion length (`--update-chunks`, forwards.length_chunks)
against one forward padded to the micro-batch's longest completion (`--update-chunks 1`): seconds and FLOPs of
the update a step, same configuration as bench/lanpo_overhead.py. Runs alternate (1, K, 1, K, ...) in fresh
processes through bench/work.py; ratios are of the medians over every step but the first, with 95 %
bootstrap intervals, and for the update also paired by step (both arms sample the same rollouts).

    python bench/update_chunks.py                          # GRPO, 128 new tokens, 2 rounds x 5 steps
    python bench/update_chunks.py --feedback both --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402
from lanpo_overhead import run  # noqa: E402

import stats  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=4, help="--update-chunks against 1")
    ap.add_argument("--feedback", default="none", help="none (GRPO) or both (LANPO)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-problems", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--gamma", type=float, default=0.5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="runs/bench/update_chunks.json")
    args = ap.parse_args()
    args.both_flags = ""
    work = Path(tempfile.mkdtemp(prefix="update_chunks_"))
    arms = {1: [], args.chunks: []}
    for r in range(args.rounds):
        for k in arms:
            arms[k] += run(work / f"{k}-{r}", args.feedback, args, ["--update-chunks", str(k)])
    timed = lambda k, f: [f(r) for r in arms[k] if r["step"] > 1]  # noqa: E731
    seconds = lambda r: r["time_update"] + r["time_logprob"]  # noqa: E731
    gflop = lambda r: r["work/update_gflop"]  # noqa: E731
    padding = lambda r: r["work/update_padding_gflop"] / r["work/update_gflop"]  # noqa: E731
    result = {"args": vars(args), "steps": {str(k): v for k, v in arms.items()}}
    for name, f in (("update_s", seconds), ("update_gflop", gflop), ("step_s", lambda r: r["time_step"])):
        one, many = timed(1, f), timed(args.chunks, f)
        result[name] = {"1": float(np.median(one)), str(args.chunks): float(np.median(many)),
                        "ratio": float(np.median(many) / np.median(one)),
                        "ratio_95": stats.median_ratio_interval(many, one)}
    # the same step in both arms samples the same rollouts (the update differs in float rounding only)
    pairs = [(a, b) for a, b in zip(timed(args.chunks, lambda r: r), timed(1, lambda r: r))
             if a["step"] == b["step"] and a["response_len_mean"] == b["response_len_mean"]]
    logs = [float(np.log(seconds(a) / seconds(b))) for a, b in pairs]
    mean, low, high = stats.interval([logs])
    result["update_s_paired"] = {"steps": len(pairs), "ratio": float(np.exp(mean)),
                                 "ratio_95": [float(np.exp(low)), float(np.exp(high))]}
    result["padding_share"] = {str(k): float(np.mean(timed(k, padding))) for k in arms}
    print(f"--feedback {args.feedback}, B={args.batch_problems} G={args.group_size}, {args.max_new_tokens} new tokens, "
          f"{args.rounds} rounds x {args.steps} steps (step 1 not counted); --update-chunks {args.chunks} against 1")
    for name in ("update_s", "update_gflop", "step_s"):
        r = result[name]
        print(f"  {name:13s} {r['1']:8.1f} {r[str(args.chunks)]:8.1f}   ratio {r['ratio']:.2f} "
              f"[{r['ratio_95'][0]:.2f}, {r['ratio_95'][1]:.2f}]")
    p = result["update_s_paired"]
    print(f"  update_s paired by step ({p['steps']} steps with the same rollouts): geometric mean ratio "
          f"{p['ratio']:.2f} [{p['ratio_95'][0]:.2f}, {p['ratio_95'][1]:.2f}]")
    print(f"  padding share of the update's FLOPs: {result['padding_share']['1']:.2f} -> "
          f"{result['padding_share'][str(args.chunks)]:.2f}")
    common.save_json(result, args.out)


if __name__ == "__main__":
    main()
