"""Data parallel on CPU: `torchrun --nproc_per_node 2 lanpo.py --cpu` (accelerate sees MULTI_CPU, gloo).
(`accelerate launch --cpu --num_processes 2` starts one process in accelerate 1.x: it needs MPI for more.)"""

import json
import os
import subprocess
import sys

from conftest import ROOT

RUNNER = """
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
import config, cpu, math_grader, lanpo
from accelerate import PartialState
from conftest import fake_grade
math_grader.grade = fake_grade  # the tiny random model never answers right: reward length parity
cpu.native_bf16 = lambda cpuinfo=None: ""  # --dtype auto is fp32 on every machine: runs compared exactly
pool = lanpo.main(config.parse_config(sys.argv[1:]))
out = sys.argv[sys.argv.index("--out-dir") + 1]
pool.save(f"{{out}}/pool-rank{{PartialState().process_index}}.jsonl")
"""

ARGS = ["--cpu", "--steps", "2", "--batch-problems", "4", "--group-size", "4", "--micro-batch", "4",
        "--max-new-tokens", "8",
        "--synthetic-size", "4", "--eval-every", "2", "--eval-size", "6", "--relevance-threshold", "0",
        "--abstract-max-tokens", "8", "--feedback", "both", "--report-to", "none", "--lr", "1e-2"]


def _launch(tmp_path, model_dir, out, processes, *extra):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(root=str(ROOT), tests=str(ROOT / "tests")))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([*launcher, str(script), "--model", str(model_dir), "--out-dir", str(out), *ARGS, *extra],
                   check=True, env=env, capture_output=True, timeout=600)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_share_one_pool_and_log_every_rollout(tiny_model_dir, tmp_path):
    two = _launch(tmp_path, tiny_model_dir, tmp_path / "two", 2)
    _launch(tmp_path, tiny_model_dir, tmp_path / "one", 1)
    pool0 = (tmp_path / "two" / "pool-rank0.jsonl").read_text()
    assert pool0 == (tmp_path / "two" / "pool-rank1.jsonl").read_text()
    trials = [json.loads(line) for line in pool0.splitlines()]
    assert len(trials) == 2 * 4 * 4  # both ranks' rollouts of both steps
    for r in two:  # metrics cover all B*G rollouts of both ranks
        assert r["scratch/count"] + r["reflect/count"] + r["abstract/count"] == 16
        assert r["pool_trials"] == 16 * r["step"]
    assert "eval_accuracy" in two[1]
    # one process and two processes train on the same problems in the same order
    order = lambda out: [(t["step"], t["problem_id"]) for t in  # noqa: E731
                         map(json.loads, (out / "pool-rank0.jsonl").read_text().splitlines())]
    assert sorted(order(tmp_path / "two")) == sorted(order(tmp_path / "one"))
    by_step = lambda out: {s: sorted({p for st, p in order(out) if st == s}) for s in (1, 2)}  # noqa: E731
    assert by_step(tmp_path / "two") == by_step(tmp_path / "one")
    assert two[1]["reflect/count"] > 0 and two[1]["abstract/count"] > 0


def test_two_processes_make_principles_ahead_for_each_others_problems(tiny_model_dir, tmp_path):
    """--abstract-ahead under 2 processes: each makes the next step's principles for its own problems inside
    its sampling call, and the cache entries reach both ranks, so step 3's abstraction rollouts run on both."""
    runs = _launch(tmp_path, tiny_model_dir, tmp_path / "ahead", 2, "--steps", "3", "--eval-every", "0",
                   "--abstract-ahead")
    assert [r["principles_made"] > 0 for r in runs] == [False, True, False]
    # step 3: every problem has both kinds, so n = 2 feedback rollouts split into 1 reflection + 1 abstraction
    assert runs[1]["abstract/count"] == 0 and runs[2]["abstract/count"] == 4
    assert runs[2]["principles_cached"] == 4  # every problem of step 3, over both ranks
    pool0 = (tmp_path / "ahead" / "pool-rank0.jsonl").read_text()
    assert pool0 == (tmp_path / "ahead" / "pool-rank1.jsonl").read_text()
