"""Run lanpo.py under DDP, DeepSpeed ZeRO-2, ZeRO-3 or FSDP2 on CPU: two gloo processes started by the
users' own command, `accelerate launch --config_file configs/<engine>.yaml lanpo.py ...`.

accelerate selects DeepSpeed and FSDP only on GPU-like devices, so this file, which accelerate launches in
place of lanpo.py, adjusts accelerate's process state for the CPU and then calls `lanpo.main` unchanged:
- zero2, zero3: accelerate's DeepSpeed set-up with the gloo backend named (without a name it finds no
  backend on a CPU and each process runs alone);
- fsdp: the gloo process group is treated as a GPU-like one whose tensors live on the CPU, and the
  rank-0-only weight loading (a GPU feature of FSDP) is switched off;
- ddp: lanpo's own --cpu (accelerate's MULTI_CPU).
It also makes what the tests check observable: the optimizer updates the engine applied after each lanpo
step, each process's experience pool, processes that make different numbers of forward passes outside
the update (each rank runs `rank` extra forwards before every relevance/principles pass), non-main
processes that write their checkpoint files late (a rename that does not wait for them loses them), and on
request processes that want different numbers of update forwards (recording the numbers they made).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"ddp": "ddp.yaml", "zero2": "zero2.yaml", "zero3": "zero3.yaml", "fsdp": "fsdp.yaml"}


def launch(engine: str, args: list[str], processes: int = 2, timeout: int = 300,
           uneven_chunks: bool = False) -> subprocess.CompletedProcess:
    """Run lanpo under `engine` ("single" = one plain process, no launcher) and return the finished process
    (stdout and stderr captured); raises with the processes' output if it fails. uneven_chunks: rank r asks
    for 1 + 2r forwards over each micro-batch's completions in the update (`forwards.chunk_count`), and as many
    over its distinct prompts (`forwards.prompt_chunk_count`)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", LANPO_TEST_ENGINE=engine, DS_ACCELERATOR="cpu",
               LANPO_TEST_UNEVEN_CHUNKS="1" if uneven_chunks else "")
    if engine == "single":
        command = [sys.executable, __file__, *args]
    else:
        with socket.socket() as s:  # a free port per launch: tests run one after another
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "configs" / CONFIGS[engine]), "--num_processes", str(processes),
                   "--mixed_precision", "no", "--main_process_port", str(port), __file__, *args]
        if engine == "ddp":
            command.append("--cpu")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if done.returncode:
        raise AssertionError(f"{engine} run failed (rc {done.returncode}):\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-6000:]}")
    return done


def engine_updates(out_dir: Path, rank: int = 0) -> list[int]:
    """Optimizer updates the engine had applied after each lanpo step (cumulative)."""
    return json.loads((out_dir / f"engine-updates-rank{rank}.json").read_text())


def final_weights(out_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out_dir / "final").state_dict()


# ----------------------------------------------------------------------------------------------------------
# The launched side


def _prepare_cpu_engine(engine: str) -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if engine in ("zero2", "zero3"):
        PartialState(backend="gloo")
    elif engine == "fsdp":
        os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = os.environ["FSDP_SYNC_MODULE_STATES"] = "false"
        PartialState._prepare_backend = lambda self, cpu=False, sagemaker_dp=False, backend=None: (
            "gloo", DistributedType.MULTI_GPU)


def _count_updates(model, optimizer) -> int:
    if hasattr(model, "global_steps"):  # a DeepSpeed engine
        return int(model.global_steps)
    steps = [int(state["step"]) for state in optimizer.optimizer.state.values() if "step" in state]
    return max(steps, default=0)


def _run(argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    engine = os.environ["LANPO_TEST_ENGINE"]
    if engine != "single":
        _prepare_cpu_engine(engine)

    import torch
    from accelerate import Accelerator, PartialState
    from conftest import fake_grade

    import abstract
    import config
    import cpu
    import forwards
    import lanpo
    import math_grader
    import update

    math_grader.grade = fake_grade  # the tiny random model never answers right: reward length parity
    cpu.native_bf16 = lambda cpuinfo=None: ""  # --dtype auto is fp32 on every machine: engines compared exactly
    out_dir = Path(argv[argv.index("--out-dir") + 1])
    updates: list[int] = []

    real_update = update.policy_update

    def recorded_update(model, ref_model, optimizer, *args, **kwargs):
        stats = real_update(model, ref_model, optimizer, *args, **kwargs)
        updates.append(_count_updates(model, optimizer))
        return stats

    real_lessons = abstract.lessons_for

    def uneven_lessons(model, tokenizer, *args, **kwargs):
        ids = torch.tensor([[1, 2, 3]], device=model.device)
        with torch.no_grad():
            for _ in range(PartialState().process_index):
                model(ids)
        return real_lessons(model, tokenizer, *args, **kwargs)

    real_save = Accelerator.save_state

    def late_save(self, *args, **kwargs):
        if not self.is_main_process:
            time.sleep(1.0)
        return real_save(self, *args, **kwargs)

    update.policy_update, abstract.lessons_for, Accelerator.save_state = recorded_update, uneven_lessons, late_save
    groups_made: list[int] = []
    ranges_made: list[int] = []
    if os.environ.get("LANPO_TEST_UNEVEN_CHUNKS"):
        real_chunks, real_cuts = forwards.length_chunks, forwards.prompt_column_cuts
        wanted = lambda most: min(most, 1 + 2 * PartialState().process_index)  # noqa: E731
        forwards.chunk_count = lambda lengths, most, price=None: wanted(most)
        forwards.prompt_chunk_count = lambda ids, mask, n_completion, most: wanted(most)
        forwards.length_chunks = lambda lengths, chunks: groups_made.append(chunks) or real_chunks(lengths, chunks)
        forwards.prompt_column_cuts = lambda lengths, width, ranges: (ranges_made.append(ranges)
                                                                      or real_cuts(lengths, width, ranges))
    pool = lanpo.main(config.parse_config(argv))
    rank = PartialState().process_index
    pool.save(out_dir / f"pool-rank{rank}.jsonl")
    (out_dir / f"engine-updates-rank{rank}.json").write_text(json.dumps(updates))
    (out_dir / f"update-groups-rank{rank}.json").write_text(json.dumps([groups_made, ranges_made]))


if __name__ == "__main__":
    _run(sys.argv[1:])
