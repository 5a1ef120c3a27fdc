"""bf16 against fp32 on the CPU: the default run's step (`./run.sh`'s settings) with `--dtype fp32` and with
`--dtype bf16-mixed` (every forward under bf16 autocast, fp32 master weights), alternating in
fresh processes (fp32, bf16-mixed, fp32, ...), each `--steps` steps from the same seed with an evaluation of
`--eval-size` problems before the first and after the last. Reports each phase's median seconds a step over
every step of every round, the ratio fp32/bf16-mixed of each, the whole runs' wall time, and what the sampler
mismatch measured (sampler_kl, the ratio quantiles, the share of tokens the TIS cap truncated): whether the
correction has anything to correct. Needs a CPU with native bf16 (cpu.native_bf16) to mean anything.

    python bench/precision.py                  # 2 rounds x 3 steps, eval on 32 problems
    python bench/precision.py --rounds 1 --steps 1 --eval-size 8          # smoke run
    python bench/precision.py --flags="--model qwen2.5-coder-0.5b"        # another model
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cpu  # noqa: E402

DTYPES = ("fp32", "bf16-mixed")
PHASES = ("time_generate", "time_relevance", "time_abstraction", "time_logprob", "time_update",
          "time_step")
MISMATCH = ("sampler_kl", "sampler_ratio_p01", "sampler_ratio_p99", "sampler_ratio_max", "sampler_is_capped")


def run_once(dtype: str, out: Path, args) -> tuple[float, list[dict]]:
    """One lanpo.py run in a fresh process: (wall seconds, its metrics lines)."""
    command = [sys.executable, str(ROOT / "lanpo.py"), "--dtype", dtype, "--out-dir", str(out), "--steps",
               str(args.steps), "--eval-every", str(args.steps), "--eval-size", str(args.eval_size),
               "--report-to", "none", "--seed", str(args.seed), *shlex.split(args.flags)]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return wall, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--eval-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flags", default="", help="more lanpo.py flags for both arms, one string")
    ap.add_argument("--out-dir", default="runs/bench/precision")
    args = ap.parse_args(argv)
    flag = cpu.native_bf16()
    print(f"native bf16: {flag or 'none (bf16 is emulated here: expect it slower than fp32)'}")
    out_dir = ROOT / args.out_dir
    walls = {d: [] for d in DTYPES}
    records = {d: [] for d in DTYPES}
    for r in range(args.rounds):
        for dtype in DTYPES:
            run_dir = out_dir / f"{dtype}-round{r}"
            if run_dir.exists():
                raise SystemExit(f"{run_dir} exists: choose another --out-dir (nothing was changed)")
            wall, lines = run_once(dtype, run_dir, args)
            walls[dtype].append(wall)
            records[dtype] += lines
            steps = ", ".join(f"{x['time_step']:.1f}" for x in lines)
            print(f"round {r} {dtype}: {wall:.0f} s, steps {steps} s")
    table = {}
    print(f"\n| phase (median s a step over {args.rounds} x {args.steps} steps) | fp32 | bf16-mixed | fp32 / bf16 |")
    print("|---|---|---|---|")
    for phase in PHASES + ("time_eval",):
        a = [x[phase] for x in records["fp32"] if phase in x]
        b = [x[phase] for x in records["bf16-mixed"] if phase in x]
        if not b:
            continue
        fa, fb = float(np.median(a)) if a else float("nan"), float(np.median(b))
        table[phase] = {"fp32": fa, "bf16-mixed": fb}
        print(f"| {phase} | {fa:.2f} | {fb:.2f} | {fa / fb if fb else float('nan'):.2f}x |")
    wa, wb = walls["fp32"], walls["bf16-mixed"]
    print(f"| whole run (wall, per round) | {', '.join(f'{w:.0f}' for w in wa)} | {', '.join(f'{w:.0f}' for w in wb)}"
          f" | {', '.join(f'{x / y:.2f}x' for x, y in zip(wa, wb))} |")
    mismatch = {}
    for d in DTYPES:
        mismatch[d] = {k: [x[k] for x in records[d] if k in x] for k in MISMATCH}
        parts = [f"{k} {min(v):.3g}..{max(v):.3g}" for k, v in mismatch[d].items() if v]
        print(f"sampler mismatch, {d} (range over steps): {'; '.join(parts)}")
    acc = {d: [x["eval_accuracy"] for x in records[d] if "eval_accuracy" in x] for d in DTYPES}
    print(f"held-out accuracy after {args.steps} steps ({args.eval_size} problems, per round): "
          + "; ".join(f"{d} {', '.join(f'{a:.3f}' for a in v)}" for d, v in acc.items()))
    result = {"native_bf16": flag, "phases": table, "walls": walls, "mismatch": mismatch, "accuracy": acc,
              "settings": vars(args)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
