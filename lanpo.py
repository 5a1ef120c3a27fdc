"""LANPO: GRPO for math reasoning, with language feedback (reflection on earlier attempts, abstracted
lessons from similar problems) guiding exploration. One readable script: the steps, setup, the loop.

    python lanpo.py                                # embedded SmolLM2-135M on built-in arithmetic, CPU
    accelerate launch lanpo.py --model Qwen2.5-7B --dataset math_train --eval-dataset math500 ...

Read top to bottom: the steps of the algorithm (problems, prompts, what each rollout trains on, rewards,
advantages) -> held-out evaluation -> setup() (data, model, optimizer, pool) -> train(), whose loop is the step:
pick problems, build prompts, sample G rollouts each, grade, group advantages, policy update, remember,
log/eval/checkpoint. The update itself (micro-batches, loss terms, the optimizer) is update.py; multi-process
concerns live in distributed.py, the run directory in rundir.py, prompt texts in prompts.py, the settings
(Config, one field per --flag, and their checks) in config.py, what a step logs and the run's summary lines in
report.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import parse_flag_from_env, set_seed

import abstract
import config
import cpu
import data
import distill
import distributed
import grpo
import math_grader
import models
import pool as pool_lib
import prompts
import reflect
import report
import reward
import rollout
import rundir
import scoring
import update
from config import Config
from pool import ExperiencePool, Trial
from rollout import Completion, generate_completions
from update import UpdateBatch

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


def plan_group(group_size: int, ratio: float, can_reflect: bool, can_abstract: bool) -> list[str]:
    """Rollout kinds of one group. n = round(ratio * G) (halves up) rollouts get feedback when the problem
    has some (can_*: the kind is on and the problem has its feedback), the rest start from scratch. When both
    kinds can, reflection takes ceil(n/2) and abstraction floor(n/2); when only one can, it takes all n."""
    n = config.feedback_slots(group_size, ratio) if (can_reflect or can_abstract) else 0
    n_reflect = (n + 1) // 2 if (can_reflect and can_abstract) else (n if can_reflect else 0)
    n_abstract = n - n_reflect
    return ["scratch"] * (group_size - n) + ["reflect"] * n_reflect + ["abstract"] * n_abstract


@dataclass
class Prompt:
    text: str      # what the policy is sampled with
    plain: str     # the from-scratch prompt of the same problem (trained on under --feedback-grad strip/distill)
    kind: str      # scratch | reflect | abstract
    context: str   # the feedback it carries, as stored in the pool
    teacher: str = ""  # the feedback prompt a self-distillation teacher sees for this problem ("" = none)


def build_prompts(tokenizer, problems: list[dict], pool: ExperiencePool, lessons: dict[str, str],
                  cfg: Config) -> list[Prompt]:
    """One prompt per rollout, B groups of G. Reflection shows the model's own earlier responses and never
    their rewards (prompts.reflection_request cannot take one); only the leaky ablations add labels.
    With --self-distill-coef, each problem's teacher prompt is its reflection prompt, else its principles one."""
    out = []
    teach = cfg.self_distill_coef > 0
    for problem in problems:
        plain = prompts.render_prompt(tokenizer, prompts.problem_request(problem["problem"]), cfg.one_shot)
        earlier = pool.attempts(problem["id"], cfg.reflect_attempts, None if cfg.reflect_source == "any" else "scratch")
        can_reflect = cfg.uses_reflection and len(earlier) >= reflect.MODES[cfg.reflect_mode].least_attempts
        can_abstract = problem["id"] in lessons and cfg.uses_abstraction
        kinds = plan_group(cfg.group_size, cfg.feedback_ratio, can_reflect, can_abstract)
        by_kind = {"scratch": (plain, "")}  # each kind's prompt is built once per problem, then shared by its slots
        if "reflect" in kinds or (teach and can_reflect):
            # the labels are read only by the leaky ablations: reward-agnostic reflection never calls for them
            by_kind["reflect"] = reflect.reflection_prompt(
                tokenizer, problem["problem"], [t.response for t in earlier], attempt_tokens=cfg.attempt_tokens,
                one_shot=cfg.one_shot, mode=cfg.reflect_mode,
                labels=lambda: ([t.reward for t in earlier], problem["answer"]))
        if "abstract" in kinds or (teach and can_abstract):
            context = lessons[problem["id"]]
            request = prompts.abstraction_request(problem["problem"], context, raw=cfg.abstract_mode == "raw")
            by_kind["abstract"] = (prompts.render_prompt(tokenizer, request, cfg.one_shot), context)
        teacher = by_kind.get("reflect", by_kind.get("abstract", ("", "")))[0] if teach else ""
        for kind in kinds:
            text, context = by_kind[kind]
            out.append(Prompt(text, plain, kind, context, teacher))
    return out


@dataclass
class Rollouts:
    """This process's rollouts of one step, in rollout order: group g is rollouts g*G .. g*G+G-1."""
    problems: list[dict]            # each rollout's problem
    prompts: list[Prompt]           # what each was sampled with
    completions: list[Completion]
    rewards: torch.Tensor           # the verifier's numerical reward of each
    advantages: torch.Tensor        # group-relative (computed over every process's groups)

    @property
    def kinds(self) -> list[str]:
        return [p.kind for p in self.prompts]


def feedback_model_texts(tokenizer, problems: list[dict], lessons: dict[str, str], completions: list[Completion],
                         kinds: list[str], cfg: Config, eos_ids: list[int]) -> list[Completion]:
    """RLTF-FM's targets: for each problem with principles this step, (the problem and the group's first
    from-scratch attempt) -> (the principles, then the end-of-turn token), as a prompt/completion pair."""
    end_of_turn = models.end_of_turn_id(tokenizer, eos_ids)
    texts = []
    for g, problem in enumerate(problems):
        if problem["id"] not in lessons:
            continue
        first = next(i for i in range(g * cfg.group_size, (g + 1) * cfg.group_size) if kinds[i] == "scratch")
        attempt = reflect.shorten(completions[first].text, tokenizer, cfg.attempt_tokens)
        request = prompts.feedback_model_request(problem["problem"], attempt)
        principles = prompts.neutralize(lessons[problem["id"]], prompts.special_token_strings(tokenizer))
        target = torch.tensor(tokenizer(principles, add_special_tokens=False).input_ids + [end_of_turn])
        texts.append(Completion(rollout.token_ids(tokenizer, prompts.render_prompt(tokenizer, request, one_shot=False)),
                                target, False, principles))
    return texts


def update_batch(tokenizer, r: Rollouts, group_problems: list[dict], lessons: dict[str, str], cfg: Config,
                 eos_ids: list[int], world: int) -> UpdateBatch:
    """What each rollout trains on: the whole mixed group on the prompts it was sampled with (context), or
    feedback rollouts moved to the plain prompt (strip, distill); teachers for self-distillation; the
    feedback-modelling targets; zero-advantage groups and truncated completions dropped when asked. Each
    decision is taken the same on every process, and every process makes as many feedback-modelling passes
    (ZeRO-3/FSDP forwards are collective): those with fewer texts pad with zero-weight copies."""
    train_on, behaviour, teachers, advantages = r.completions, None, None, r.advantages
    if cfg.feedback_grad != "context" and distributed.on_any_process(any(k != "scratch" for k in r.kinds)):
        behaviour = [None if p.kind == "scratch" else c for c, p in zip(r.completions, r.prompts)]
        train_on = [c if p.kind == "scratch" else
                    dataclasses.replace(c, prompt_ids=rollout.token_ids(tokenizer, p.plain))
                    for c, p in zip(r.completions, r.prompts)]
    if cfg.self_distill_coef > 0:  # the same completion, scored by the model shown the feedback
        teachers = [dataclasses.replace(c, prompt_ids=rollout.token_ids(tokenizer, p.teacher))
                    if p.kind == "scratch" and p.teacher else None for c, p in zip(r.completions, r.prompts)]
    keep = list(range(len(r.completions)))
    if cfg.drop_zero_adv_groups:  # groups with equal rewards carry no signal: leave them out entirely
        live = r.rewards.view(-1, cfg.group_size).std(dim=1) > 0
        keep = [i for i in keep if live[i // cfg.group_size]]
    if len(keep) < len(r.completions):
        train_on, advantages = [train_on[i] for i in keep], advantages[keep]
        behaviour = [behaviour[i] for i in keep] if behaviour else None
        teachers = [teachers[i] for i in keep] if teachers else None
    # a cut-off answer was never finished: its reward says nothing about its tokens. Its row stays in the
    # forwards (every process makes as many) but leaves the loss and the normalisers
    in_loss = [not (cfg.mask_truncated and c.truncated) for c in train_on]
    texts = (feedback_model_texts(tokenizer, group_problems, lessons, r.completions, r.kinds, cfg, eos_ids)
             if cfg.feedback_model_coef > 0 else [])
    # Normalisers of the whole batch over all processes, divided by the number of processes, because
    # data-parallel training averages the processes' gradients.
    total, most = distributed.totals({
        "seqs": sum(in_loss), "tokens": sum(len(c.completion_ids) for c, kept in zip(train_on, in_loss) if kept),
        "teacher_tokens": sum(len(t.completion_ids) for t, kept in zip(teachers or [], in_loss)
                              if t is not None and kept),
        "feedback_tokens": sum(len(c.completion_ids) for c in texts), "feedback_texts": len(texts)})
    window = {name: total[name] / world for name in ("seqs", "tokens", "teacher_tokens", "feedback_tokens")}
    if not window["teacher_tokens"]:
        teachers = None  # no teacher on any process this step: no teacher forward passes
    padding = most["feedback_texts"] - len(texts)
    weighted = [(c, 1.0) for c in texts] + [((texts or r.completions)[0], 0.0)] * padding
    return UpdateBatch(train_on, advantages, behaviour, teachers, weighted, window, torch.tensor(in_loss),
                       float(total["feedback_texts"]))


def grade_all(rewarder: reward.Rewarder, completions: list[Completion],
              problems: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(reward, the math grader's verdict) of each completion: the reward is the verdict unless --reward names a
    function of the user's; the accuracy metrics always read the verdict."""
    texts, cut = [c.text for c in completions], [c.truncated for c in completions]
    rewards = torch.tensor(rewarder.scores(problems, texts, cut))
    if rewarder.spec == reward.MATH:
        return rewards, rewards
    return rewards, torch.tensor(math_grader.grade_batch(texts, [p["answer"] for p in problems], truncated=cut))


def step_advantages(kinds: list[str], all_rewards: torch.Tensor, cfg: Config, accelerator) -> torch.Tensor:
    """This process's slice of the group-relative advantages over every process's groups (RLTF-SD under
    --feedback-grad distill: each group against its from-scratch rollouts only)."""
    if cfg.feedback_grad == "distill":
        from_scratch = torch.tensor([k == "scratch" for k in distributed.gather(kinds)])
        advantages = distill.first_turn_advantages(all_rewards, from_scratch, cfg.group_size, cfg.adv_scale)
    else:
        advantages = grpo.group_advantages(all_rewards, cfg.group_size, cfg.adv_scale)
    return distributed.my_share(advantages, accelerator)


# ----------------------------------------------------------------------------------------------------------
# Held-out evaluation (what a step logs: report.py)


SAMPLES_PER_EVAL = 4  # held-out responses in samples.md at each evaluation (and the first rollout of each kind)


def evaluate_accuracy(run: Run, step: int, trials: list[Trial] = ()) -> dict[str, float]:
    """Greedy accuracy on held-out problems from plain prompts (no feedback at test time), through
    evaluate.py's code path (scoring.evaluate_rows), with its 95 % interval; each process takes every
    world-th problem. The per-problem verdicts go to heldout.jsonl (the paired gain at the end uses them);
    samples.md (and wandb's `samples` table) gets the first of this step's `trials` of each kind and the first
    held-out responses, with their reward or verdict."""
    t0 = time.perf_counter()
    mine = run.eval_rows[run.accelerator.process_index::run.accelerator.num_processes]
    with run.full_weights():
        label = f"held-out eval, step {step}" if run.accelerator.is_main_process else ""
        records = scoring.evaluate_rows(run.policy, run.tokenizer, mine, "zero-shot", run.cfg, run.eos_ids,
                                        progress=label)[0] if mine else []
    records = distributed.gather(records)
    summary = scoring.summarize(records, 1)
    out = {"eval_accuracy": summary["avg@1"], "eval_accuracy_low": summary["avg@1_low"],
           "eval_accuracy_high": summary["avg@1_high"], "eval_truncated": summary["truncated"],
           "time_eval": time.perf_counter() - t0}
    if run.accelerator.is_main_process:
        rundir.append_metrics(run.out_dir / "heldout.jsonl", {"step": step, "ids": [r["id"] for r in records],
                                                       "verdicts": [r["verdicts"][0] for r in records]})
        first = {t.kind: t for t in reversed(trials)}  # the first trial of each kind
        rows = [(f"train {t.kind}", t.problem, t.response, t.reward) for t in first.values()]
        rows += [("held-out", r["problem"], r["responses"][0], r["verdicts"][0]) for r in records[:SAMPLES_PER_EVAL]]
        rundir.append_samples(run.out_dir / "samples.md", step, rows)
        if run.wandb is not None:
            import wandb
            run.wandb.log({"samples": wandb.Table(columns=["kind", "problem", "response", "score"],
                                                  data=[list(row) for row in rows])}, step=step)
        if run.tensorboard is not None:
            run.tensorboard.add_text("samples", rundir.samples_table(rows), step)
    return out


# ----------------------------------------------------------------------------------------------------------
# Setup


@dataclass
class Run:
    """What setup() prepares and the training loop uses."""
    cfg: Config
    accelerator: Accelerator
    model: torch.nn.Module           # as prepared by accelerate (wrapped under DDP/DeepSpeed/FSDP)
    policy: torch.nn.Module          # the unwrapped model: generate() lives on it
    ref_model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    tokenizer: object
    eos_ids: list[int]
    train_rows: list[dict]
    eval_rows: list[dict]
    pool: ExperiencePool
    lessons_cache: dict[str, dict]   # principles per problem id, reused for --abstract-refresh steps
    start_step: int
    out_dir: Path
    wandb: object | None
    tensorboard: object | None       # torch's SummaryWriter under --report-to tensorboard
    previous_sigint: object | None
    rewarder: reward.Rewarder

    @contextlib.contextmanager
    def full_weights(self):
        """Context in which the whole weights are on every process (see distributed.gathered_for_generation),
        LoRA adapters merged into a copy of them under --lora-merged-sampling (models.merged_lora), and under
        --dtype bf16-mixed the forwards in bf16 autocast for the whole context: autocast converts each fp32
        master weight to bf16 once, at its first use, and keeps the copy until the context ends (one
        conversion per sampling call, where accelerate's autocast around each forward would convert every
        weight at every decoding step). The sampler computes what the update computes: the same weights,
        under the same autocast."""
        merged = self.cfg.lora_rank > 0 and self.cfg.lora_merged_sampling
        bf16 = self.cfg.dtype == "bf16-mixed"
        with distributed.gathered_for_generation(self.model, self.accelerator), \
                (models.merged_lora(self.policy) if merged else contextlib.nullcontext()), \
                torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16, enabled=bf16):
            yield

    @functools.cached_property
    def families(self) -> dict[str, str]:
        """Training problem id -> its family, where the data has families (synthetic:rules), else empty."""
        return {r["id"]: r["family"] for r in self.train_rows if "family" in r}

    def embedding_weights(self):
        """--retriever policy embeds problems as they enter the pool: those forwards need the whole weights."""
        return self.full_weights() if self.cfg.retriever == "policy" else contextlib.nullcontext()


def drop_long_prompts(rows: list[dict], tokenizer, cfg: Config, skipped) -> list[dict]:
    """Rows whose plain prompt fits --max-prompt-tokens; a longer one is an error naming it, or with
    --skip-bad-rows is dropped and counted in `skipped`."""
    kept = []
    for row in rows:
        text = prompts.render_prompt(tokenizer, prompts.problem_request(row["problem"]), cfg.one_shot)
        n = len(tokenizer(text, add_special_tokens=False).input_ids)
        if n <= cfg.max_prompt_tokens:
            kept.append(row)
        elif cfg.skip_bad_rows:
            skipped["prompt_too_long"] += 1
        else:
            raise SystemExit(f"{cfg.dataset}: problem {row['id']!r} makes a {n}-token prompt, over "
                             f"--max-prompt-tokens {cfg.max_prompt_tokens} (--skip-bad-rows drops such rows)")
    if not kept:
        raise SystemExit(f"{cfg.dataset}: no problem fits --max-prompt-tokens {cfg.max_prompt_tokens}")
    return kept


def setup(cfg: Config) -> Run:
    """Every check that needs no model first (nothing is written until they pass), then data, model,
    reference, optimizer, the experience pool, and the state of a resumed run."""
    on_gpu = torch.cuda.is_available() and not cfg.cpu
    sharded = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED") or parse_flag_from_env("ACCELERATE_USE_FSDP")
    resolved, why = config.resolve_dtype(cfg.dtype, on_gpu, cpu.native_bf16(), sharded)
    # the run computes in `resolved`; its settings (config.json, the resume and ablate checks) keep what was
    # asked, so that `auto` resumes as `auto`
    asked, cfg = cfg, dataclasses.replace(cfg, dtype=resolved)
    # step_scheduler_with_optimizer=False: accelerate would otherwise step the LR schedule once per process
    # per update (it assumes a dataloader whose batches grew with the process count)
    accelerator = Accelerator(cpu=cfg.cpu, step_scheduler_with_optimizer=False,
                              mixed_precision="bf16" if cfg.dtype == "bf16-mixed" else "no")
    if why:
        accelerator.print(why)
    distributed.check_launch(accelerator, cfg)
    update.check_loss_terms(cfg)
    if accelerator.device.type == "cpu":  # DeepSpeed, imported by accelerate when installed, runs on the CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # too (said, not guessed with a warning about GPUs)
    if cfg.share_prompt_forward and (cfg.gradient_checkpointing or accelerator.is_fsdp2):
        accelerator.print("--share-prompt-forward is off: it needs a KV cache through the backward pass, which "
                          "gradient checkpointing drops and FSDP2 frees")
        cfg = dataclasses.replace(cfg, share_prompt_forward=False)
    settings = dataclasses.replace(cfg, dtype=asked.dtype)  # what config.json records and resume compares
    out_dir = Path(cfg.out_dir)
    resume_from = rundir.check_out_dir(settings, out_dir)
    rundir.check_wandb(cfg)
    rundir.check_tensorboard(cfg)
    models.check_available(cfg.model)
    rewarder = reward.Rewarder(cfg.reward, cfg.reward_timeout)
    set_seed(cfg.seed)
    train_rows, eval_rows, skipped = data.load_rows(cfg)

    # weights in this dtype; "bf16-mixed" keeps fp32 master weights (AdamW updates of ~1e-6 vanish in bf16)
    # and computes in bf16 through accelerate's autocast
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.dtype, torch.float32)
    if cfg.dtype == "bf16-mixed" and cfg.lora_rank > 0:
        dtype = torch.bfloat16  # a frozen base needs no fp32 master copy; peft keeps the adapter in fp32
    tokenizer = models.load_tokenizer(cfg.model)
    train_rows = drop_long_prompts(train_rows, tokenizer, cfg, skipped)
    if skipped:
        twins = (" (twin_of_held_out: training problems that are held-out ones in other words; --eval-overlap "
                 "refuse names them)") if skipped["twin_of_held_out"] else ""
        accelerator.print(f"skipped {sum(skipped.values())} rows of {cfg.dataset}: {dict(skipped)}{twins}")
    if resume_from is None and rundir.unstarted_run(out_dir):
        accelerator.print(f"{out_dir} holds a run that stopped before its first checkpoint (nothing to resume): "
                          "starting it again in its place")
    if accelerator.is_main_process:
        rundir.claim(out_dir)  # every check passed: the run may write, and no other run may
        # a run that claimed and finished while this one loaded its data left what the first check did not see
        if rundir.check_out_dir(settings, out_dir) != resume_from:
            raise SystemExit(f"{out_dir} changed while this run started (another run wrote it): nothing was changed")
    out_dir.mkdir(parents=True, exist_ok=True)
    previous_sigint = (signal.signal(signal.SIGINT, rundir.interrupted(out_dir))
                       if threading.current_thread() is threading.main_thread() else None)  # only it may
    model = models.load_policy(cfg.model, dtype, cfg.gradient_checkpointing, cfg.lora_rank, cfg.lora_alpha,
                               cfg.lora_targets)
    if accelerator.device.type == "cpu" and not cpu.speed_up(model, cfg.cpu_rows_first_matmul, cfg.cpu_host_memory):
        accelerator.print("malloc is not glibc's: CPU updates may spend much of their time re-faulting freed memory")
    eos_ids = models.eos_token_ids(model, tokenizer)
    ref_model = None
    if cfg.beta > 0 and cfg.lora_rank == 0:
        ref_dtype = torch.bfloat16 if (on_gpu or cfg.dtype == "bf16-mixed") and dtype == torch.float32 else dtype
        ref_model = models.load_policy(cfg.model, ref_dtype).eval().requires_grad_(False).to(accelerator.device)
        if accelerator.device.type == "cpu":
            cpu.contiguous_lm_head(ref_model)  # a frozen bf16 head is where a strided input costs most
    per_process = cfg.batch_problems // accelerator.num_processes
    optimizer, scheduler = update.make_optimizer(cfg, model)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:  # DeepSpeed clips and steps inside backward(), at the boundary micro_batch() marks;
        # these two only have to agree with its batch-size check (the loss is never divided by them)
        plugin.deepspeed_config["gradient_accumulation_steps"] = per_process * cfg.group_size // cfg.micro_batch
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.micro_batch
        plugin.deepspeed_config["gradient_clipping"] = cfg.max_grad_norm
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    policy = accelerator.unwrap_model(model)

    start_step = 0
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        start_step = json.loads((resume_from / "lanpo_state.json").read_text())["step"]
        accelerator.print(f"resumed from {resume_from} at step {start_step}" + (
            f": all {cfg.steps} steps are done; --resume {out_dir} --steps N with N > {cfg.steps} extends the run"
            if start_step >= cfg.steps else ""))
    if accelerator.is_main_process:
        for name in ("metrics.jsonl", "heldout.jsonl"):
            if start_step:
                rundir.truncate_metrics(out_dir / name, start_step)
            else:  # a new run, or one that stopped before its first checkpoint started again in its place
                (out_dir / name).unlink(missing_ok=True)
        (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(settings), indent=2))
    wandb_run = rundir.start_wandb(cfg, accelerator)
    tensorboard = rundir.start_tensorboard(cfg, accelerator)
    math_grader.warm_up()

    # the experience pool (filled under every --feedback, so a GRPO run's pool can be used later)
    index = (pool_lib.TfidfIndex() if cfg.retriever == "tfidf"
             else pool_lib.EmbeddingIndex(abstract.hidden_state_embedder(policy, tokenizer)))
    run = Run(cfg, accelerator, model, policy, ref_model, optimizer, scheduler, tokenizer, eos_ids, train_rows,
              eval_rows, ExperiencePool(cfg.pool_per_problem, cfg.pool_max_problems, index), {}, start_step,
              out_dir, wandb_run, tensorboard, previous_sigint, rewarder)
    if start_step:
        with run.embedding_weights():
            run.pool.load(resume_from / "pool.jsonl")
        run.lessons_cache = json.loads((resume_from / "lessons_cache.json").read_text())
    return run


# ----------------------------------------------------------------------------------------------------------
# The loop


def share_lessons(run: Run, problems: list[dict]) -> None:
    """Every process's cache entries for its problems, into every process's cache."""
    for made in distributed.gather([{p["id"]: run.lessons_cache[p["id"]] for p in problems
                                     if p["id"] in run.lessons_cache}]):
        run.lessons_cache.update(made)


def lessons_for_step(run: Run, problems: list[dict], step: int) -> tuple[dict[str, str], abstract.AbstractionStats]:
    """Inter-sample feedback for this process's problems: relevant similar problems from the pool, distilled
    into principles (cached for --abstract-refresh steps, the cache shared by every process). Under
    --abstract-ahead only what the previous step made (`upcoming_lessons`) is served: nothing is made now."""
    cfg = run.cfg
    if not cfg.wants_lessons:
        return {}, abstract.AbstractionStats()
    if cfg.abstract_ahead:
        hits = {p["id"]: abstract.fresh_entry(run.lessons_cache, p["id"], step, cfg.abstract_refresh) for p in problems}
        served = {i: h["lessons"] for i, h in hits.items() if h is not None and h["lessons"]}
        empty = sum(h is not None and not h["lessons"] for h in hits.values())
        return served, abstract.AbstractionStats(cached=len(served), cached_empty=empty)
    with run.full_weights():  # processes make different numbers of forwards
        lessons, stats = abstract.lessons_for(run.policy, run.tokenizer, run.pool, problems, run.lessons_cache, step,
                                              cfg, run.eos_ids, run.families)
    share_lessons(run, problems)
    return lessons, stats


def upcoming_lessons(run: Run, step: int) -> abstract.PendingLessons | None:
    """--abstract-ahead: retrieve and judge the next step's problems now, so that their principles are
    generated inside this step's sampling call (one generate call a step instead of two). They are made
    from the pool before this step's trials, by the policy before this step's update."""
    cfg = run.cfg
    if not (cfg.abstract_ahead and cfg.wants_lessons and step + 1 < cfg.steps):
        return None
    upcoming = distributed.my_share(problems_for_step(run.train_rows, step + 1, cfg.batch_problems, cfg.seed),
                                    run.accelerator)
    with run.full_weights():  # processes make different numbers of forwards
        return abstract.prepare_lessons(run.policy, run.tokenizer, run.pool, upcoming, run.lessons_cache, step + 1,
                                        cfg, run.families)


def sample(run: Run, rollout_prompts: list[Prompt], pending: abstract.PendingLessons | None,
           step: int) -> list[Completion]:
    """The step's G rollouts per problem and, under --abstract-ahead, the next step's principles (greedy)
    in the same generate calls; those principles go into every process's cache for the next step."""
    cfg, requests = run.cfg, pending.requests if pending else []
    texts = [p.text for p in rollout_prompts] + requests
    greedy = [False] * len(rollout_prompts) + [True] * len(requests)
    limits = [cfg.max_new_tokens] * len(rollout_prompts) + [cfg.abstract_max_tokens] * len(requests)
    with rundir.oom_hint("sampling", f"--gen-batch {max(1, cfg.gen_batch // 2)}", run.out_dir), run.full_weights():
        outs = generate_completions(run.policy, run.tokenizer, texts, eos_ids=run.eos_ids, max_new_tokens=limits,
                                    temperature=cfg.temperature, top_p=cfg.top_p, greedy=greedy,
                                    batch_size=cfg.gen_batch, share_prefill=cfg.share_prefill,
                                    compiled=cfg.compile_decoding)
    if pending is not None:
        abstract.finish_lessons(pending, outs[len(rollout_prompts):], run.lessons_cache, step + 1, cfg.abstract_mode)
        share_lessons(run, [p for p, _ in pending.todo])
    return outs[:len(rollout_prompts)]


def release_host_memory(run: Run) -> None:
    """--cpu-host-memory trim: what a phase freed goes back to the kernel before the next phase allocates."""
    if run.cfg.cpu_host_memory == "trim" and run.accelerator.device.type == "cpu":
        cpu.trim_freed_host_memory()


def stop_after_bad_updates(bad_in_row: int, update_stats: dict, step: int, run: Run) -> int:
    """Consecutive optimizer updates skipped for a non-finite loss or gradient; too many stop the run."""
    bad_in_row = bad_in_row + int(update_stats["skipped_updates"]) if update_stats["skipped_updates"] else 0
    if bad_in_row >= run.cfg.max_bad_updates:
        raise SystemExit(f"{bad_in_row} optimizer updates in a row had a non-finite loss or gradient (step "
                         f"{step + 1}); none was applied. Lower --lr or --max-grad-norm, or check the data. "
                         f"Checkpoints so far: {[p.name for p in rundir.checkpoint_dirs(run.out_dir)]}")
    return bad_in_row


def step_record(run: Run, step: int, r: Rollouts, all_rewards: torch.Tensor, all_verdicts: torch.Tensor,
                b: UpdateBatch, update_stats: dict, lesson_stats: abstract.AbstractionStats,
                timings: dict[str, float]) -> dict:
    """The step's metrics line, over every process's rollouts (see the README's Metrics table); accuracies are
    the math grader's verdicts (`all_verdicts`), whatever --reward scores."""
    cfg = run.cfg
    per_rollout = distributed.gather([(k, len(c.completion_ids), c.truncated, len(c.prompt_ids))
                                      for k, c in zip(r.kinds, r.completions)])
    lengths = torch.tensor([n for _, n, _, _ in per_rollout], dtype=torch.float32)
    record = {
        "step": step + 1,
        "reward_mean": all_rewards.mean().item(),
        "reward_std": all_rewards.std().item(),
        "accuracy": all_verdicts.float().mean().item(),
        "response_len_mean": lengths.mean().item(),
        "truncated_frac": float(np.mean([t for _, _, t, _ in per_rollout])),
        "zero_adv_group_frac": (all_rewards.view(-1, cfg.group_size).std(dim=1) == 0).float().mean().item(),
        **distributed.mean_over_processes(update_stats),
        "lr": run.scheduler.get_last_lr()[0],
        "tokens_per_s": lengths.sum().item() / max(timings["time_generate"], 1e-9),
        **timings,
        "grader_timeouts": math_grader.timeouts(),
    }
    if cfg.compile_decoding:
        record.update(rollout.compiling_stats())  # so far in this process: a shape compiled twice would show
    if cfg.reward != reward.MATH:
        record["reward_failures"] = run.rewarder.failures  # so far in this process's run, as grader_timeouts
    if cfg.self_distill_coef > 0:
        record["self_distill_tokens"] = b.window["teacher_tokens"] * run.accelerator.num_processes
    if cfg.feedback_model_coef > 0:
        record["feedback_model_texts"] = b.modelled_texts
    record.update(report.kind_metrics([k for k, _, _, _ in per_rollout], all_rewards, all_verdicts, lengths,
                               [t for _, _, t, _ in per_rollout]))
    record.update(report.feedback_metrics(lesson_stats, run.pool, [n for _, _, _, n in per_rollout], run.families))
    return record


def main(cfg: Config) -> ExperiencePool:
    """Train; returns this process's experience pool (the same on every process)."""
    try:
        return train(setup(cfg))
    finally:  # the run directory is free again, also for another run in this process
        rundir.release(Path(cfg.out_dir))


def train(run: Run) -> ExperiencePool:
    from tqdm.auto import tqdm

    cfg, accelerator, tokenizer, pool = run.cfg, run.accelerator, run.tokenizer, run.pool
    rank, bad_in_row = accelerator.process_index, 0
    if run.eval_rows and cfg.eval_at_start and run.start_step == 0:
        accelerator.print(f"step 0: held-out accuracy {evaluate_accuracy(run, 0)['eval_accuracy']:.3f}")
    progress = tqdm(range(run.start_step, cfg.steps), initial=run.start_step, total=cfg.steps,
                    disable=not accelerator.is_main_process, desc="grpo" if cfg.feedback == "none" else "lanpo")
    for step in progress:
        t_step = time.perf_counter()
        # per-step (and per-process) seed: a resumed run samples exactly as an uninterrupted one
        torch.manual_seed(cfg.seed * 1_000_003 + step * 1_009 + rank)

        # 1. this process's problems (whole groups), language feedback from the pool, one prompt per rollout
        mine = distributed.my_share(problems_for_step(run.train_rows, step, cfg.batch_problems, cfg.seed),
                                    accelerator)
        lessons, lesson_stats = lessons_for_step(run, mine, step)
        rollout_prompts = build_prompts(tokenizer, mine, pool, lessons, cfg)
        pending = upcoming_lessons(run, step)  # --abstract-ahead: the next step's, made in this step's call
        if pending is not None:
            pending.stats.cached, pending.stats.cached_empty = lesson_stats.cached, lesson_stats.cached_empty
            lesson_stats = pending.stats

        # 2. sample G rollouts per problem
        t0 = time.perf_counter()
        completions = sample(run, rollout_prompts, pending, step)
        release_host_memory(run)
        timings = {"time_generate": time.perf_counter() - t0}

        # 3. grade against the gold answers (numerical reward; feedback never changes it)
        t0 = time.perf_counter()
        problems = [p for p in mine for _ in range(cfg.group_size)]
        rewards, verdicts = grade_all(run.rewarder, completions, problems)
        timings["time_grade"] = time.perf_counter() - t0
        all_rewards = torch.tensor(distributed.gather(rewards.tolist()))  # every process's groups, rank order
        all_verdicts = torch.tensor(distributed.gather(verdicts.tolist()))

        # 4. group-relative advantages over each problem's G rollouts
        advantages = step_advantages([p.kind for p in rollout_prompts], all_rewards, cfg, accelerator)
        rollouts = Rollouts(problems, rollout_prompts, completions, rewards, advantages)

        # 5. clipped policy-gradient update(s) over the whole mixed group, plus the terms switched on
        batch = update_batch(tokenizer, rollouts, mine, lessons, cfg, run.eos_ids, accelerator.num_processes)
        with rundir.oom_hint("the policy update", f"--micro-batch {max(1, cfg.micro_batch // 2)} or "
                             "--gradient-checkpointing", run.out_dir):
            update_stats = update.policy_update(run.model, run.ref_model, run.optimizer, run.scheduler,
                                                accelerator, batch, cfg, tokenizer.pad_token_id)
        bad_in_row = stop_after_bad_updates(bad_in_row, update_stats, step, run)
        release_host_memory(run)

        # 6. remember every trial of every process: the pool feeds reflection and abstraction later
        trials = distributed.gather([Trial(prob["id"], prob["problem"], p.kind, p.context, c.text, rew, step + 1,
                                           data.content_key(prob))
                                     for prob, p, c, rew in zip(problems, rollout_prompts, completions,
                                                                rewards.tolist())])
        with run.embedding_weights():
            pool.add(trials)

        # 7. log, evaluate (greedy, plain prompts: no feedback at test time), checkpoint
        record = step_record(run, step, rollouts, all_rewards, all_verdicts, batch, update_stats, lesson_stats,
                             timings)
        if run.eval_rows and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            record.update(evaluate_accuracy(run, step + 1, trials))
        record["time_step"] = time.perf_counter() - t_step
        record["memory_peak_gb"] = max(distributed.gather([report.peak_memory_gb(accelerator.device)]))
        if accelerator.is_main_process:
            rundir.append_metrics(run.out_dir / "metrics.jsonl", record)
            if run.wandb is not None:
                run.wandb.log(record, step=step + 1)
            if run.tensorboard is not None:
                rundir.tensorboard_log(run.tensorboard, record, step + 1)
            progress.set_postfix(report.progress_fields(record, cfg))
        # after the metrics line: a kill between the two re-runs this step, never loses its line
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or (step + 1 == cfg.steps and cfg.final_checkpoint):
            rundir.save_checkpoint(accelerator, run.out_dir, step + 1, cfg.keep_last, pool, run.lessons_cache,
                                   run.policy, tokenizer)
    finish(run)
    return pool


def finish(run: Run) -> None:
    """The final weights as a model directory (gathered from shards under ZeRO-3/FSDP: every process calls it)."""
    state_dict = run.accelerator.get_state_dict(run.model)
    if run.accelerator.is_main_process:
        final = rundir.save_final(run.out_dir, run.cfg.steps, run.policy, run.tokenizer, state_dict)
        records = [json.loads(line) for line in (run.out_dir / "metrics.jsonl").read_text().splitlines()]
        run.accelerator.print(report.truncation_summary(records))
        for line in report.feedback_summary(records, run.cfg):
            run.accelerator.print(line)
        if gain := report.heldout_gain(run.out_dir):
            run.accelerator.print(gain)
        run.accelerator.print(f"done: metrics in {run.out_dir / 'metrics.jsonl'}, model in {final}")
    if run.wandb is not None:
        run.wandb.finish()
    if run.tensorboard is not None:
        run.tensorboard.close()
    run.rewarder.close()
    # every process leaves together and closes its process group: a rank exiting while gloo's threads still run
    # aborts ("terminate called without an active exception") after the run has finished its work
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()
    if run.previous_sigint is not None:
        signal.signal(signal.SIGINT, run.previous_sigint)


if __name__ == "__main__":
    main(config.parse_config())
