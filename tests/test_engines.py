"""DDP, DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 train alike: two CPU processes each, launched the users' way
(`accelerate launch --config_file configs/<engine>.yaml`, see tests/engines.py), 3 steps of --feedback both
with 2 micro-batches per process and 2 PPO epochs, a linear LR schedule with warmup, the policy retriever
and the relevance filter on. Each engine is compared with the DDP run of the same micro-batches.

Tolerances: loss and grad-norm rel 1e-4 (seen: equal to ~1e-6; the engines reduce gradients in other
orders); final weights: mean abs difference 2e-7 (float32's spacing at 1.0, where the norm weights sit, is
1.2e-7; seen 1.3e-7 on a norm weight) and max 1e-4 = 1 % of one update at lr 1e-2 (seen: 2e-7
everywhere except one ZeRO-3 embedding entry at 1.5e-5: Adam divides a near-zero gradient's round-off by
its own tiny scale); a resumed run reproduces its own uninterrupted run to abs 1e-6."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from conftest import training_metrics as metrics
from engines import engine_updates, final_weights, launch
from transformers import AutoModelForCausalLM

ENGINES = ["ddp", "zero2", "zero3", "fsdp"]
STEPS, PPO_EPOCHS = 3, 2
SETTINGS = ["--steps", str(STEPS), "--batch-problems", "4", "--group-size", "4", "--micro-batch", "4",
            "--ppo-epochs", str(PPO_EPOCHS), "--max-new-tokens", "8", "--synthetic-size", "4", "--eval-every", "3",
            "--eval-size", "4", "--feedback", "both", "--relevance-threshold", "0.2", "--retriever", "policy",
            "--abstract-max-tokens", "8", "--report-to", "none", "--lr", "1e-2", "--lr-schedule", "linear",
            "--warmup-steps", "1", "--save-every", "2", "--keep-last", "3"]
GRADIENT_TERMS = ["--feedback-grad", "distill", "--self-distill-coef", "0.5", "--feedback-model-coef", "0.1",
                  "--steps", "2", "--save-every", "0"]


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """run(engine, *extra) -> out dir of that launch, made once per module."""
    done = {}

    def get(engine: str, *extra: str):
        key = (engine, *extra)
        if key not in done:
            out = tmp_path_factory.mktemp(engine)
            launch(engine, ["--model", str(tiny_model_dir), "--out-dir", str(out), *SETTINGS, *extra],
                   processes=1 if engine == "single" else 2)
            done[key] = out
        return done[key]
    return get


def _same_numbers(a: list[dict], b: list[dict], rel: float) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=rel, abs=1e-7), (ra["step"], k)


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_steps_schedule_pools_and_checkpoints(run, engine):
    """Per lanpo step the engine applies exactly --ppo-epochs optimizer updates; the LR per step is the
    single-process run's (accelerate used to step the schedule once per process: negative LRs on 2);
    both processes hold the same pool; a checkpoint holds every process's files."""
    out = run(engine)
    assert engine_updates(out, 0) == engine_updates(out, 1) == [PPO_EPOCHS * (s + 1) for s in range(STEPS)]
    lrs = [r["lr"] for r in metrics(out)]
    assert lrs == pytest.approx([r["lr"] for r in metrics(run("single"))], abs=1e-12)
    assert lrs == pytest.approx([0.008, 0.004, 0.0], abs=1e-12)  # warmup 1 of 6 updates, then linear to 0
    assert (out / "pool-rank0.jsonl").read_bytes() == (out / "pool-rank1.jsonl").read_bytes()
    trials = [json.loads(line) for line in (out / "pool-rank0.jsonl").read_text().splitlines()]
    assert len(trials) == 4 * 8 and {t["step"] for t in trials} == {2, 3}  # 4 problems x --pool-per-problem 8
    for step in (2, 3):  # rank 1 writes late (tests/engines.py): the rename must wait for it
        assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in
                                                                 (out / "checkpoints" / f"step-{step:06d}").iterdir()}
    records = metrics(out)
    for key in ("relevance_candidates", "principles_made", "abstract/count", "reflect/count"):
        assert sum(r[key] for r in records) > 0, key
    assert "eval_accuracy" in records[-1]


@pytest.mark.parametrize("engine", ["zero2", "zero3", "fsdp"])
def test_engine_trains_like_ddp(run, engine):
    """Same per-step loss and grad-norm (and every other metric), same pool, same final weights. FSDP2 turns
    the update's prompt sharing off (it frees what the shared prompt's backward needs), so its DDP twin
    runs without it too: the same maths, but another float order than the tolerances allow for."""
    unshared = json.loads((run(engine) / "config.json").read_text())["share_prompt_forward"] is False
    assert unshared == (engine == "fsdp")
    out, ddp = run(engine), run("ddp", *(["--no-share-prompt-forward"] if unshared else []))
    _same_numbers(metrics(out), metrics(ddp), rel=1e-4)
    assert (out / "pool-rank0.jsonl").read_bytes() == (ddp / "pool-rank0.jsonl").read_bytes()
    mine, theirs = final_weights(out), final_weights(ddp)
    assert mine.keys() == theirs.keys()
    for name in mine:
        difference = (mine[name] - theirs[name]).abs()
        assert difference.max() <= 1e-4 and difference.mean() <= 2e-7, (name, difference.max(), difference.mean())


@pytest.mark.parametrize("engine", ["zero3", "fsdp"])
def test_bf16_mixed_trains_like_fp32_on_sharded_engines(run, tiny_model_dir, engine):
    """--dtype bf16-mixed under ZeRO-3 (DeepSpeed's bf16 mode: bf16 weights, fp32 master copies in the
    optimizer) and FSDP2 (fp32 sharded weights, bf16 compute through its mixed-precision policy): the engine
    applies every update, the sampler mismatch is logged, and the final weights land where the fp32 DDP run's
    do, up to bf16's rounding: a mean distance under 0.3 of the mean fp32 update (seen 0.06 and 0.18;
    1.0 if the updates were lost)."""
    out, fp32 = run(engine, "--dtype", "bf16-mixed"), run("ddp")
    assert engine_updates(out) == [PPO_EPOCHS * (s + 1) for s in range(STEPS)]
    assert all(0 <= r["sampler_kl"] < 1e-3 for r in metrics(out))
    mine, theirs = final_weights(out), final_weights(fp32)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()

    def mean_distance(a, b):
        return sum((a[k].float() - b[k].float()).abs().mean().item() for k in b) / len(b)
    assert mean_distance(mine, theirs) < 0.3 * mean_distance(theirs, start)


def _trials(out) -> list[tuple]:
    """(problem, kind, response) of every trial in rank 0's pool of a run."""
    return [(t["problem_id"], t["kind"], t["response"]) for t in
            map(json.loads, (out / "pool-rank0.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("engine", ["zero3", "fsdp"])
def test_compiled_decoding_on_gathered_weights_samples_as_eager_ddp(run, engine):
    """--compile-decoding where generate runs on weights gathered from their shards (ZeRO-3) or on layers
    unsharded for the duration (FSDP2, whose hooks split the step into several graphs): every process samples
    the eager DDP run's trials, and step 3, with step 2's shapes, compiles nothing new."""
    out = run(engine, "--compile-decoding")
    assert _trials(out) == _trials(run("ddp"))
    assert (out / "pool-rank0.jsonl").read_bytes() == (out / "pool-rank1.jsonl").read_bytes()
    graphs = [r["compiled_graphs"] for r in metrics(out)]
    assert graphs[0] >= 1 and graphs[2] == graphs[1]


@pytest.mark.parametrize("engine", ["zero3", "fsdp"])
def test_lora_sampling_from_merged_weights_on_sharded_engines(run, engine):
    """LoRA with --lora-merged-sampling (the default) where the merge goes into weights gathered from their
    shards (ZeRO-3) or unsharded for the duration (FSDP2), and the original tensors go back before they are
    sharded again: the same trials and losses as DDP sampling through the adapters."""
    out, ddp = run(engine, "--lora-rank", "4"), run("ddp", "--lora-rank", "4", "--no-lora-merged-sampling")
    assert _trials(out) == _trials(ddp)
    assert [r["loss"] for r in metrics(out)] == pytest.approx([r["loss"] for r in metrics(ddp)], rel=1e-4)


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_resume_reproduces_the_run(run, engine, tiny_model_dir, tmp_path):
    """A run killed after its step-2 checkpoint and resumed ends where the uninterrupted run ended:
    weights, optimizer state and metrics (FSDP used to restore the weights but not the optimizer)."""
    whole = run(engine)
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    for leftover in ("final", "checkpoints/step-000003", "pool-rank0.jsonl", "pool-rank1.jsonl"):
        shutil.rmtree(cut / leftover) if (cut / leftover).is_dir() else (cut / leftover).unlink()
    launch(engine, ["--model", str(tiny_model_dir), "--out-dir", str(cut), *SETTINGS, "--resume"])
    _same_numbers(metrics(cut), metrics(whole), rel=1e-6)
    assert engine_updates(cut) == [PPO_EPOCHS * STEPS]  # the engine's update count was restored, then stepped
    resumed, uninterrupted = final_weights(cut), final_weights(whole)
    for name in resumed:
        torch.testing.assert_close(resumed[name], uninterrupted[name], atol=1e-6, rtol=0, msg=name)


def test_zero3_with_every_feedback_gradient_term_trains_like_ddp(run):
    """RLTF-SD importance weights, self-distillation teacher passes and the feedback-modelling passes (a
    varying number of micro-batches, refused under DeepSpeed before) under ZeRO-3 and DDP."""
    zero3, ddp = run("zero3", *GRADIENT_TERMS), run("ddp", *GRADIENT_TERMS)
    late = metrics(zero3)[-1]
    assert late["self_distill_tokens"] > 0 and late["feedback_model_texts"] > 0 and 0 < late["distill_is_weight"] <= 1
    _same_numbers(metrics(zero3), metrics(ddp), rel=1e-4)
    assert engine_updates(zero3) == [PPO_EPOCHS, 2 * PPO_EPOCHS]


@pytest.mark.parametrize("engine", ["zero3", "fsdp"])
def test_processes_agree_on_the_update_forwards(run, engine, tiny_model_dir, tmp_path):
    """Rank 0 wants one forward over each micro-batch's completions and one over its distinct prompts, rank 1
    three of each (`forwards.chunk_count` and `prompt_chunk_count` patched): both make three, so the collective
    forwards of ZeRO-3 and FSDP2 stay in step, and the run trains as the DDP run does (whose forwards are not
    split: the same sums in another order). Each process would otherwise make its own number and the run would
    hang or fail."""
    out = tmp_path / engine
    launch(engine, ["--model", str(tiny_model_dir), "--out-dir", str(out), *SETTINGS, "--save-every", "0",
                    "--no-final-checkpoint"], uneven_chunks=True)
    made = [json.loads((out / f"update-groups-rank{rank}.json").read_text()) for rank in (0, 1)]
    groups, ranges = zip(*made)
    assert groups[0] == groups[1] and len(groups[0]) > 0 and set(groups[0]) == {3}
    if engine == "zero3":  # FSDP2 runs without prompt sharing (see the DDP run below): no prompt ranges
        assert ranges[0] == ranges[1] and len(ranges[0]) > 0 and set(ranges[0]) == {3}
    _same_numbers(metrics(out), metrics(run("ddp", *(["--no-share-prompt-forward"] if engine == "fsdp" else []))),
                  rel=1e-4)


def test_launch_that_accelerate_does_not_see_is_refused(tiny_model_dir, tmp_path):
    """Two processes started, but accelerate (no --cpu, no GPU) sees each alone: refused before the model
    loads, nothing written (it used to run two independent jobs into one out-dir)."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           str(ROOT / "lanpo.py"), "--model", str(tiny_model_dir), "--out-dir", str(out),
                           "--steps", "1", "--report-to", "none"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode != 0
    assert "2 processes were launched (WORLD_SIZE=2) but accelerate runs this one alone" in done.stderr
    assert 'lanpo.py", line' not in done.stderr  # a message, not a traceback from lanpo
    assert not out.exists()


def test_fsdp1_config_is_refused(tiny_model_dir, tmp_path):
    config = tmp_path / "fsdp1.yaml"
    config.write_text((ROOT / "configs" / "fsdp.yaml").read_text().replace("fsdp_version: 2", "fsdp_version: 1"))
    env = dict(os.environ, OMP_NUM_THREADS="1", LANPO_TEST_ENGINE="fsdp")
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                           "--num_processes", "2", "--mixed_precision", "no", str(ROOT / "tests" / "engines.py"),
                           "--model", str(tiny_model_dir), "--out-dir", str(tmp_path / "out"), "--steps", "1"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode != 0 and "FSDP1 is not supported: use FSDP2" in done.stderr
    assert 'lanpo.py", line' not in done.stderr
    assert not (tmp_path / "out").exists()


def test_accelerate_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    expected = {"ddp.yaml": "MULTI_GPU", "zero2.yaml": "DEEPSPEED", "zero3.yaml": "DEEPSPEED", "fsdp.yaml": "FSDP"}
    for name, kind in expected.items():
        config = load_config_from_file(str(ROOT / "configs" / name))
        assert str(config.distributed_type).endswith(kind) and config.mixed_precision == "bf16"
    assert load_config_from_file(str(ROOT / "configs" / "zero3.yaml")).deepspeed_config["zero_stage"] == 3
    assert load_config_from_file(str(ROOT / "configs" / "fsdp.yaml")).fsdp_config["fsdp_version"] == 2
