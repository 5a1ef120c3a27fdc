"""The policy update: a step's rollouts in micro-batches (the log-probs that stay fixed through the update
computed once), one forward of the policy on each, the loss terms summed, backward, and --ppo-epochs optimizer
updates, and the optimizer with its LR schedule. lanpo.py decides what each rollout trains on (`UpdateBatch`);
this module only carries it out.

A loss term is a function term(f, mb, cfg, window, stats) -> loss tensor, listed in LOSS_TERMS with the setting
that switches it on. `f` is the policy's forward on micro-batch `mb`: `f.logits` and `f.logps` carry the graph;
`f.entropy` is a statistic without one (call `f.entropy_with_grad()` to train on entropy); `f.old` and the
`mb` log-probs are constants. `window` holds the whole batch's normalisers (divide by them, so the
micro-batches add up to the batch's loss); record statistics with `add_stat` (averaged) or `add_loss`
(summed). cfg is config.Config.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

import distill
import distributed
import forwards
import grpo
from rollout import Completion, pack


@dataclass
class UpdateBatch:
    """What the policy update trains on: one entry per rollout kept (see `update_batch`)."""
    completions: list[Completion]                  # the prompt each is trained on, and its completion
    advantages: torch.Tensor
    behaviour: list[Completion | None] | None      # each on the prompt it was sampled with (None: the same)
    teachers: list[Completion | None] | None       # each on its self-distillation teacher's prompt (None: none)
    feedback_texts: list[tuple[Completion, float]]  # RLTF-FM targets with weight 1 (0: padding)
    window: dict[str, float]                       # loss normalisers of the whole batch (all processes)
    in_loss: torch.Tensor                          # per rollout: does it count in the loss (--mask-truncated)
    modelled_texts: float = 0.0                    # RLTF-FM targets over all processes (logged)

    @property
    def learns(self) -> bool:
        """Whether any process has a token in the loss (the same answer on every process): with none (every
        group dropped, or every completion truncated under --mask-truncated) the update is skipped."""
        return self.window["seqs"] > 0 or self.window["feedback_tokens"] > 0


@dataclass
class MicroBatch:
    """One forward/backward's rollouts, padded, and what their loss terms need beside the policy's forward."""
    ids: torch.Tensor
    attn: torch.Tensor
    cmask: torch.Tensor                        # completion tokens (1) vs padding (0)
    advantages: torch.Tensor
    loss_mask: torch.Tensor                    # cmask less the rows left out of the loss (--mask-truncated)
    old_logps: torch.Tensor | None = None      # pi_old (None: on-policy with one epoch, pi_old = pi)
    sampling_logps: torch.Tensor | None = None  # the sampling prompt's log-probs (strip, distill)
    off_policy: torch.Tensor | None = None     # rows trained on another prompt than they were sampled with
    ref_logps: torch.Tensor | None = None      # reference policy, when beta > 0
    sampler_logps: torch.Tensor | None = None  # the sampler's log-probs of the tokens it drew (0 where none)
    sampler_rows: torch.Tensor | None = None   # rows trained on the prompt they were sampled with, that have them
    sampler_log_ratio: torch.Tensor | None = None  # log pi_old - log pi_sampler on those rows' tokens (first epoch)
    teacher_inputs: tuple | None = None        # (ids, attn) of the self-distillation teacher's prompts
    has_teacher: torch.Tensor | None = None
    chunks: int = 1                            # forwards over its completions (forwards.chunk_count, agreed)
    prompt_chunks: int = 1                     # and over its distinct prompts (forwards.prompt_chunk_count, agreed)


@dataclass
class Forward:
    """The policy's forward pass on a micro-batch (completion positions only), and its teacher's targets."""
    logits: torch.Tensor      # [rows, C, V] at the sampling temperature, with the graph
    logps: torch.Tensor       # log pi(token) [rows, C], with the graph; 0 outside the loss mask
    entropy: torch.Tensor     # per-token entropy, a statistic: no graph (see entropy_with_grad)
    mask: torch.Tensor        # the micro-batch's loss mask as floats
    old: torch.Tensor         # pi_old's log-probs (constants)
    teacher_logps: torch.Tensor | None = None
    teacher_ids: torch.Tensor | None = None

    def entropy_with_grad(self) -> torch.Tensor:
        """Per-token entropy [rows, C] with its graph, for a term that trains on it (0 outside the loss mask).
        Computed only when a term calls it, one row at a time; the backward keeps each row's float32 softmax,
        C x V x 4 bytes a row (48 tokens x 49k vocabulary: 9 MB; 2k tokens x 152k: 1.2 GB)."""
        rows = []
        for row in self.logits:
            logp = torch.log_softmax(row.float(), dim=-1)
            rows.append(-(logp.exp() * logp).sum(-1))
        return torch.stack(rows) * self.mask


def micro_batches(model, ref_model, b: UpdateBatch, cfg, pad_id: int, device) -> list[MicroBatch]:
    """The batch in micro-batches, sorted by prompt so that they pad little and rows repeating a prompt sit
    together (the loss, a sum over the batch, does not depend on order), with the log-probs that stay fixed
    through the update computed once."""
    rows = b.completions
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i].prompt_ids), rows[i].prompt_ids.tolist(),
                                                    len(rows[i].completion_ids)))
    out = []
    for start in range(0, len(order), cfg.micro_batch):
        idx = order[start:start + cfg.micro_batch]
        ids, attn, cmask = pack([rows[i] for i in idx], pad_id, device)
        mb = MicroBatch(ids, attn, cmask, b.advantages[idx].to(device), cmask * b.in_loss[idx].to(device)[:, None])
        # every process takes the most groups any wants: under ZeRO-3 and FSDP every forward is collective
        mb.chunks = max(distributed.gather([forwards.chunk_count(mb.cmask.sum(dim=1), cfg.update_chunks)]))
        if cfg.share_prompt_forward:
            mb.prompt_chunks = max(distributed.gather([forwards.prompt_chunk_count(
                mb.ids, mb.attn, mb.cmask.shape[1], cfg.update_chunks)]))
        with torch.no_grad():
            if b.behaviour is not None:  # the same rows, on the prompt each was sampled with
                sampled = pack([rows[i] if b.behaviour[i] is None else b.behaviour[i] for i in idx], pad_id, device)
                mb.sampling_logps = forwards.token_logprobs(model, *sampled, cfg.micro_batch, cfg.temperature,
                                                        cfg.share_prompt_forward, mb.chunks, mb.prompt_chunks)[0]
                mb.off_policy = torch.tensor([b.behaviour[i] is not None for i in idx], device=device)
            if cfg.feedback_grad == "strip" and b.behaviour is not None:
                mb.old_logps = mb.sampling_logps  # pi(y | plain) / pi(y | feedback): off-policy samples
            elif cfg.ppo_epochs > 1:  # on-policy with one epoch the ratio is exactly 1: no forward needed
                mb.old_logps = forwards.token_logprobs(model, mb.ids, mb.attn, mb.cmask, cfg.micro_batch,
                                                   cfg.temperature, cfg.share_prompt_forward, mb.chunks,
                                                   mb.prompt_chunks)[0]
            if cfg.beta > 0:
                mb.ref_logps = reference_logprobs(model, ref_model, mb.ids, mb.attn, mb.cmask, cfg, mb.chunks,
                                                  mb.prompt_chunks)
        sampled_here = [rows[i].sampler_logps is not None and (b.behaviour is None or b.behaviour[i] is None)
                        for i in idx]
        if any(sampled_here):
            mb.sampler_logps = torch.zeros(mb.cmask.shape, dtype=torch.float32)
            for j, i in enumerate(idx):
                if sampled_here[j]:
                    mb.sampler_logps[j, :len(rows[i].sampler_logps)] = rows[i].sampler_logps
            mb.sampler_logps = mb.sampler_logps.to(device)
            mb.sampler_rows = torch.tensor(sampled_here, device=device)
        if b.teachers is not None:
            mb.teacher_inputs = pack([rows[i] if b.teachers[i] is None else b.teachers[i] for i in idx],
                                     pad_id, device)[:2]
            mb.has_teacher = torch.tensor([b.teachers[i] is not None for i in idx], device=device)
        out.append(mb)
    return out


def forward(model, mb: MicroBatch, cfg) -> Forward:
    """The policy on the micro-batch. A self-distillation teacher (the same model shown the feedback, no
    gradient) runs first, so its full logits are freed before the student's forward."""
    teacher_logps = teacher_ids = None
    if mb.teacher_inputs is not None:
        with torch.no_grad():
            teacher_logps, teacher_ids = distill.teacher_logprobs(forwards.completion_logits(
                model, *mb.teacher_inputs, mb.cmask.shape[1], cfg.temperature, cfg.share_prompt_forward,
                mb.chunks, mb.prompt_chunks), cfg.self_distill_topk)
    logits = forwards.completion_logits(model, mb.ids, mb.attn, mb.cmask.shape[1], cfg.temperature,
                                        cfg.share_prompt_forward, mb.chunks, mb.prompt_chunks)
    logps, entropy = forwards.selective_log_softmax(logits, mb.ids[:, -mb.cmask.shape[1]:])
    mask = mb.loss_mask.to(logps.dtype)
    logps, entropy = logps * mask, entropy * mask
    old = mb.old_logps if mb.old_logps is not None else logps.detach()
    return Forward(logits, logps, entropy, mask, old, teacher_logps, teacher_ids)


def add_stat(stats: dict, name: str, value: float, weight: float) -> None:
    """A statistic of a micro-batch: the update logs its weighted mean over the micro-batches."""
    stats.setdefault(name, []).append((value, weight))


def add_loss(stats: dict, name: str, value: float) -> None:
    """A loss term's value on a micro-batch: the update logs the sum over its micro-batches (each term is
    normalised over the whole batch, so the sum is the batch's loss), averaged over the --ppo-epochs."""
    stats.setdefault(name, []).append((value, None))


def sampler_weights(f: Forward, mb: MicroBatch, cfg) -> torch.Tensor | None:
    """Truncated importance weights min(pi_old / pi_sampler, C) per token (TIS) of the rows trained on the prompt
    they were sampled with, under --dtype bf16-mixed: the sampler (cached decoding under bf16 autocast) and the
    update (a full forward under bf16 autocast) round the same policy differently, and the tokens were drawn
    from the sampler's. None (weight 1) under other dtypes, with --sampler-is-cap 0, or without sampler
    log-probs. Keeps the tokens' log ratios on `mb` for the mismatch metrics (`sampler_mismatch`)."""
    if mb.sampler_logps is None:
        return None
    tokens = f.mask * mb.sampler_rows[:, None]
    log_ratio = (f.old - mb.sampler_logps) * tokens
    if mb.sampler_log_ratio is None:  # pi_old is the same in every epoch
        mb.sampler_log_ratio = log_ratio[tokens.bool()]
    if cfg.dtype != "bf16-mixed" or cfg.sampler_is_cap == 0:
        return None
    return torch.where(tokens.bool(), torch.exp(log_ratio).clamp(max=cfg.sampler_is_cap), 1.0)


def sampler_mismatch(log_ratios: list[torch.Tensor], cap: float) -> dict[str, float]:
    """How far the sampler's token log-probs are from the update's, over the tokens that have both
    (log r = log pi_old - log pi_sampler): sampler_kl, the k3 estimate r - 1 - log r of KL(sampler || pi_old)
    from the sampler's own draws; quantiles and the largest of r; sampler_is_capped, the share of tokens whose
    weight the cap truncates. Empty without such tokens."""
    if not log_ratios or not sum(len(t) for t in log_ratios):
        return {}
    log_r = torch.cat(log_ratios).double()
    r = log_r.exp()
    q = torch.quantile(r, torch.tensor([0.01, 0.5, 0.99], dtype=r.dtype))
    out = {"sampler_kl": (r - 1 - log_r).mean().item(), "sampler_ratio_p01": q[0].item(),
           "sampler_ratio_p50": q[1].item(), "sampler_ratio_p99": q[2].item(), "sampler_ratio_max": r.max().item()}
    if cap > 0:
        out["sampler_is_capped"] = (r > cap).double().mean().item()
    return out


def policy_gradient_loss(f: Forward, mb: MicroBatch, cfg, window: dict, stats: dict) -> torch.Tensor:
    """GRPO's clipped surrogate (+ beta * KL), token-averaged as --loss-type says; under --feedback-grad
    distill each feedback rollout's tokens carry the truncated weight pi(y | plain) / pi(y | feedback), under
    --dtype bf16-mixed each other token the truncated weight pi_old / pi_sampler (`sampler_weights`)."""
    weights = sampler_weights(f, mb, cfg)
    if cfg.feedback_grad == "distill" and mb.sampling_logps is not None:
        distilled = torch.where(mb.off_policy[:, None],
                                distill.truncated_is_weights(f.old, mb.sampling_logps, cfg.distill_is_cap), 1.0)
        off = f.mask * mb.off_policy[:, None]
        if off.sum() > 0:
            add_stat(stats, "distill_is_weight", ((distilled * off).sum() / off.sum()).item(), off.sum().item())
        weights = distilled if weights is None else weights * distilled  # disjoint rows: each keeps its own
    loss, s = grpo.policy_loss(f.logps, f.old, mb.advantages, f.mask, mb.ref_logps, eps_low=cfg.eps_low,
                               eps_high=cfg.eps_high, beta=cfg.beta, loss_type=cfg.loss_type,
                               max_completion_len=cfg.max_new_tokens, window_seqs=window["seqs"],
                               window_tokens=window["tokens"], token_weights=weights)
    weight = s.pop("tokens")
    add_loss(stats, "loss", loss.item())
    s["entropy"] = (f.entropy.sum() / f.mask.sum().clamp(min=1)).item()
    for name, value in s.items():
        add_stat(stats, name, value, weight)
    return loss


def self_distill_loss(f: Forward, mb: MicroBatch, cfg, window: dict, stats: dict) -> torch.Tensor | float:
    """--self-distill-coef: divergence between the plain-prompt policy and its feedback-shown teacher, on
    the from-scratch rollouts that have a teacher; 0 when off."""
    if f.teacher_logps is None:
        return 0.0
    taught = f.mask * mb.has_teacher[:, None]
    loss, div = distill.self_distill_loss(distill.student_logprobs(f.logits, f.teacher_ids), f.teacher_logps,
                                          taught, cfg.self_distill_div, cfg.self_distill_coef,
                                          window["teacher_tokens"])
    add_loss(stats, "self_distill_loss", loss.item())
    if taught.sum() > 0:
        add_stat(stats, "self_distill_div", (div.sum() / taught.sum()).item(), taught.sum().item())
    return loss


def feedback_model_loss(model, texts: list[tuple[Completion, float]], cfg, window: dict, stats: dict,
                        pad_id: int, device) -> torch.Tensor:
    """RLTF-FM: cross-entropy of the principles given the problem and an attempt, at temperature 1 (a
    supervised target, not a sample), on a micro-batch of its own texts."""
    ids, attn, cmask = pack([c for c, _ in texts], pad_id, device)
    text_weights = torch.tensor([w for _, w in texts], device=device)
    target_logps = forwards.token_logprobs(model, ids, attn, cmask, cfg.micro_batch,
                                       share_prompts=cfg.share_prompt_forward)[0]
    loss, nll = distill.feedback_model_loss(target_logps, text_weights, cfg.feedback_model_coef,
                                            window["feedback_tokens"])
    n_tokens = (cmask.sum(dim=1) * text_weights).sum().item()
    add_loss(stats, "feedback_model_loss", loss.item())
    if n_tokens:
        add_stat(stats, "feedback_model_ce", nll.item() / n_tokens, n_tokens)
    return loss


def policy_update(model, ref_model, optimizer, scheduler, accelerator, b: UpdateBatch, cfg,
                  pad_id: int) -> dict[str, float]:
    """ppo_epochs optimizer updates on one batch, each accumulated over its micro-batches; every process
    makes the same number of forward passes. Statistics are micro-batch averages; losses add up to the
    batch's loss (each term is normalised over the whole batch, `b.window`). With nothing to learn (`b.learns`
    false on every process) no forward runs and no optimizer steps: only the timings and skipped_updates are
    logged, as no update statistic was measured."""
    if not b.learns:
        return {"time_logprob": 0.0, "time_update": 0.0, "skipped_updates": 0.0}
    device = accelerator.device
    t0 = time.perf_counter()
    micro = micro_batches(model, ref_model, b, cfg, pad_id, device)
    modelled = [b.feedback_texts[i:i + cfg.micro_batch] for i in range(0, len(b.feedback_texts), cfg.micro_batch)]
    timings = {"time_logprob": time.perf_counter() - t0}
    n_passes, stats, skipped = len(micro) + len(modelled), {}, 0
    terms = active_terms(cfg)
    t0 = time.perf_counter()
    model.train()
    for epoch in range(cfg.ppo_epochs):
        for j, mb in enumerate(micro):
            with distributed.micro_batch(accelerator, model, last=j == n_passes - 1):
                f = forward(model, mb, cfg)
                loss = sum(term(f, mb, cfg, b.window, stats) for term in terms)
                distributed.backward(accelerator, loss)
        for j, texts in enumerate(modelled):
            with distributed.micro_batch(accelerator, model, last=len(micro) + j == n_passes - 1):
                distributed.backward(accelerator, feedback_model_loss(model, texts, cfg, b.window, stats, pad_id,
                                                                      device))
        norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
        if norm is None:  # DeepSpeed clips (its gradient_clipping) and steps inside backward(): read its norm
            norm = model.get_global_grad_norm() or 0.0
        if math.isfinite(float(norm)):
            add_stat(stats, "grad_norm", float(norm), 1.0)
            optimizer.step()
            scheduler.step()
        else:  # a NaN/inf loss or gradient anywhere: this update is dropped, the weights stay as they were
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
    timings["time_update"] = time.perf_counter() - t0
    out = {k: sum(v for v, _ in vals) / cfg.ppo_epochs if vals[0][1] is None  # add_loss: summed
           else sum(v * w for v, w in vals) / max(sum(w for _, w in vals), 1e-9) for k, vals in stats.items()}
    out.setdefault("grad_norm", float("nan"))
    out.update(sampler_mismatch([mb.sampler_log_ratio for mb in micro if mb.sampler_log_ratio is not None],
                                cfg.sampler_is_cap if cfg.dtype == "bf16-mixed" else 0.0))
    return {**out, **timings, "skipped_updates": float(skipped)}


def reference_logprobs(model, ref_model, ids, attn, cmask, cfg, chunks: int, prompt_chunks: int) -> torch.Tensor:
    """Log-probs under the reference policy: the adapter-disabled model for LoRA (no second copy),
    else the frozen initial copy."""
    if ref_model is None:
        with model.disable_adapter():
            return forwards.token_logprobs(model, ids, attn, cmask, cfg.micro_batch, cfg.temperature,
                                       cfg.share_prompt_forward, chunks, prompt_chunks)[0]
    return forwards.token_logprobs(ref_model, ids, attn, cmask, cfg.micro_batch, cfg.temperature,
                               cfg.share_prompt_forward, chunks, prompt_chunks)[0]


# The terms summed into each micro-batch's loss, each with the Config field that switches it on (None: always
# on). A term whose field is 0 is never called: it costs nothing and logs nothing. A new term is one function
# above and one entry here.
LOSS_TERMS = [(policy_gradient_loss, None), (self_distill_loss, "self_distill_coef")]
OWN_PASS = ("feedback_model_coef",)  # weights of losses computed in a pass of their own (feedback modelling)


def active_terms(cfg) -> list:
    """The loss terms this run computes: those always on, and those whose field is set."""
    return [term for term, switch in LOSS_TERMS if switch is None or getattr(cfg, switch)]


def check_loss_terms(cfg) -> None:
    """Every --*-coef a run sets reaches a loss: one set that no LOSS_TERMS entry (nor a pass of its own) reads
    would train nothing, silently, so the run stops here, before any model loads."""
    read = {switch for _, switch in LOSS_TERMS} | set(OWN_PASS)
    unread = [name for name in vars(cfg) if name.endswith("_coef") and getattr(cfg, name) and name not in read]
    if unread:
        raise SystemExit(f"{', '.join('--' + n.replace('_', '-') for n in unread)} is set, but no loss term in "
                         "update.LOSS_TERMS reads it: add the term's entry (README, Adding a loss term)")


def make_optimizer(cfg, model):
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
