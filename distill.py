"""Feedback through the gradient: objectives that put the language feedback into the weights, not only
into exploration. Pure tensor functions and one prompt builder; lanpo.py wires them into the update.

- RLTF-SD (`--feedback-grad distill`, arXiv 2602.02482): a feedback rollout y ~ pi(. | x_f) is trained on
  the plain prompt x, with the from-scratch rollouts of its group as baseline (`first_turn_advantages`)
  and a truncated per-token importance weight for having been sampled under x_f (`truncated_is_weights`).
- RLTF-FM (`--feedback-model-coef`): cross-entropy of the principles text given the problem and the
  model's own attempt (`prompts.feedback_model_request`), so the model learns to produce the feedback itself.
- Self-distillation (`--self-distill-coef`): per-token divergence between the plain-prompt policy on its
  own from-scratch rollout and the same model shown the feedback (a stop-gradient teacher), over the
  teacher's top-k tokens plus one bucket for the rest of the vocabulary (`teacher_logprobs`,
  `student_logprobs`, `divergence`).
"""

from __future__ import annotations

import math

import torch

from grpo import ADV_EPS

# Smallest probability of the student's "rest of the vocabulary" bucket, 1 - (its top-k mass): below about
# 1e-6 float32 cannot tell that difference from 0. The teacher's bucket is summed exactly (no gradient).
TAIL_FLOOR = 1e-6


def first_turn_advantages(rewards: torch.Tensor, from_scratch: torch.Tensor, group_size: int,
                          scale: str = "group") -> torch.Tensor:
    """RLTF-SD's advantages: every rollout of a group is compared with the mean reward of the group's
    from-scratch rollouts (the first-turn baseline: what the plain prompt achieves), not with the mixed
    group's mean. The scale is group_advantages': the std of all G rewards (group), the batch std, or 1.
    With every rollout from scratch this is group_advantages."""
    grouped = rewards.view(-1, group_size).float()
    scratch = from_scratch.view(-1, group_size).to(grouped.dtype)
    n = scratch.sum(dim=1)
    if (n == 0).any():
        bad = int((n == 0).nonzero()[0])
        raise ValueError(f"group {bad} has no from-scratch rollout, so RLTF-SD has no baseline for it; "
                         "lower --feedback-ratio so that round(rho*G) < G")
    centred = grouped - (grouped * scratch).sum(dim=1, keepdim=True) / n[:, None]
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + ADV_EPS)
    elif scale == "batch":
        centred = centred / (rewards.float().std() + ADV_EPS)
    elif scale != "none":
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return centred.view(-1)


def truncated_is_weights(plain_logps: torch.Tensor, sampling_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_old(y_t | x, y_<t) / pi_old(y_t | x_f, y_<t), cap) per token: the feedback rollout was sampled
    under the feedback prompt x_f but is trained as if from x. Truncation bounds the variance (as in
    V-trace/TIS); cap = 0 turns the correction off (all 1), the paper's plain advantage-weighted form."""
    if cap == 0:
        return torch.ones_like(plain_logps)
    return torch.exp(plain_logps - sampling_logps).clamp(max=cap)


@torch.no_grad()
def teacher_logprobs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The teacher's log-probs [N, C, k+1] over its top-k tokens plus a last bucket for the rest of the
    vocabulary, and those token ids [N, C, k]; top_k = 0 keeps the full vocabulary [N, C, V] (ids None).
    One row at a time in float32, under no_grad: the teacher is a stop-gradient target, and only k+1
    numbers per position outlive the call. The rest bucket is summed over the other tokens themselves."""
    logps, ids = [], []
    for row in logits:
        full = torch.log_softmax(row.float(), dim=-1)
        if top_k == 0:
            logps.append(full)
            continue
        top, idx = full.topk(top_k, dim=-1)
        rest = full.scatter(-1, idx, float("-inf")).logsumexp(dim=-1, keepdim=True).clamp(min=-69.0)  # >= 1e-30
        logps.append(torch.cat([top, rest], dim=-1))
        ids.append(idx)
    return torch.stack(logps), (torch.stack(ids) if ids else None)


def student_logprobs(logits: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """The student's log-probs on the teacher's categories: the same top-k token ids plus the rest bucket
    [N, C, k+1], or the full vocabulary when ids is None. Gradients flow into `logits`; one row at a time
    in float32 (as forwards.selective_log_softmax)."""
    out = []
    for r, row in enumerate(logits):
        row = row.float()
        log_norm = torch.logsumexp(row, dim=-1, keepdim=True)
        if ids is None:
            out.append(row - log_norm)
            continue
        top = row.gather(-1, ids[r]) - log_norm
        # 1 - (top-k mass): summing the other tokens directly would keep a second V-sized tensor for backward
        rest = torch.log1p(-top.exp().sum(dim=-1, keepdim=True).clamp(max=1.0 - TAIL_FLOOR))
        out.append(torch.cat([top, rest], dim=-1))
    return torch.stack(out)


def divergence(student: torch.Tensor, teacher: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-position divergence between two distributions given as log-probs over the last dimension.
    reverse_kl = KL(student || teacher) (mode-seeking; the usual on-policy distillation loss),
    forward_kl = KL(teacher || student) (mass-covering), jsd = the Jensen-Shannon divergence (bounded by
    log 2)."""
    if kind == "reverse_kl":
        return _kl(student, teacher)
    if kind == "forward_kl":
        return _kl(teacher, student)
    if kind == "jsd":
        mixture = torch.logaddexp(student, teacher) - math.log(2.0)
        return 0.5 * _kl(student, mixture) + 0.5 * _kl(teacher, mixture)
    raise ValueError(f"divergence must be 'reverse_kl', 'forward_kl' or 'jsd', got {kind!r}")


def _kl(p_logps: torch.Tensor, q_logps: torch.Tensor) -> torch.Tensor:
    return (p_logps.exp() * (p_logps - q_logps)).sum(dim=-1)


def self_distill_loss(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, kind: str, coef: float,
                      n_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
    """coef * (sum of the per-token divergences over `mask`) / n_tokens, where n_tokens counts the taught
    tokens of the whole batch (so micro-batch terms add up to the batch mean), and the masked divergences
    [N, C]. student/teacher: log-probs [N, C, categories] from student_logprobs / teacher_logprobs."""
    div = divergence(student, teacher, kind) * mask
    return coef * div.sum() / max(n_tokens, 1e-9), div


def feedback_model_loss(target_logps: torch.Tensor, weights: torch.Tensor, coef: float,
                        n_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
    """coef * (negative log-likelihood of the feedback tokens) / n_tokens, and that summed NLL.
    target_logps [N, C] are 0 outside the feedback tokens (forwards.token_logprobs masks them); weights [N]
    are 1, or 0 for a padding copy; n_tokens counts the feedback tokens of the whole batch."""
    nll = -(target_logps.sum(dim=1) * weights).sum()
    return coef * nll / max(n_tokens, 1e-9), nll

