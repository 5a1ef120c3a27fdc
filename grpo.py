"""The maths of GRPO: group-relative advantages, the completion mask (up to the first EOS) and the clipped
policy loss with its KL term. Pure functions on tensors; no model, no I/O, no config. The forward passes
that produce the log-probs are forwards.py's.
"""

from __future__ import annotations

import torch

ADV_EPS = 1e-4  # keeps the division finite for all-equal groups (their advantage is then exactly 0)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """Group-relative advantages for rewards laid out group after group (G consecutive rows per problem).

    scale="group": (r - group mean) / (group std + eps)  -- GRPO (DeepSeekMath); sample std, as TRL.
    scale="batch": (r - group mean) / (batch std + eps)  -- less noisy for small G.
    scale="none":  r - group mean                        -- Dr. GRPO: no std division (no difficulty bias).
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} items, "
                         f"got shape {tuple(rewards.shape)}")
    grouped = rewards.view(-1, group_size).float()
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped)
        centred = centred / (std + ADV_EPS)
    elif scale == "batch":
        centred = centred / (rewards.float().std() + ADV_EPS)
    elif scale != "none":
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return centred.view(-1)


def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask over generated tokens up to and including the first EOS (any of `eos_ids`), and which rows never
    produced one (truncated). The EOS itself is trained even when pad == eos: it is the 'stop' decision."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    big = torch.full_like(positions, completion_ids.shape[1])
    first_eos = torch.where(is_eos, positions, big).min(dim=1).values
    mask = (positions[None, :] <= first_eos[:, None]).long()
    truncated = ~is_eos.any(dim=1)
    return mask, truncated


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                completion_mask: torch.Tensor, ref_logps: torch.Tensor | None = None, *,
                eps_low: float = 0.2, eps_high: float = 0.2, beta: float = 0.0, loss_type: str = "grpo",
                max_completion_len: int | None = None, window_seqs: int | None = None,
                window_tokens: int | None = None,
                token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate with asymmetric clipping (clip-higher) and an optional k3 KL penalty.

    Shapes: logps/old_logps/ref_logps/completion_mask [N, C], advantages [N].
    loss_type decides how token losses are averaged:
      grpo    -- mean over each sequence's tokens, then mean over sequences;
      dapo    -- sum over all tokens / number of tokens;
      dr_grpo -- sum over all tokens / (number of sequences x max_completion_len).
    With gradient accumulation, pass the totals of the whole accumulation window (`window_seqs`,
    `window_tokens`) so that the summed micro-batch losses equal the full-batch loss; nothing else
    divides by the number of accumulation steps. Defaults: this call's own counts.

    KL: k3 = exp(ref - logp) - (ref - logp) - 1, multiplied by the importance ratio pi/pi_old. Without the
    ratio the k3 gradient is biased (its expectation is not the gradient of KL(pi || pi_ref)); with it, the
    gradient is unbiased on- and off-policy (it equals grad KL in expectation over samples of pi_old).

    token_weights [N, C] (constants) multiply each token's whole loss: the importance weights of samples
    drawn from another distribution than pi_old (RLTF-SD's feedback rollouts). None = all 1.
    """
    mask = completion_mask.to(logps.dtype)
    log_ratio = logps - old_logps
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None].to(logps.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = None
    if beta > 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + beta * ratio * kl
    if token_weights is not None:
        per_token = per_token * token_weights

    # `or 1`: with no sequence in the loss anywhere (all masked), every sum below is 0, and so is the loss
    n_seqs = (window_seqs if window_seqs is not None else logps.shape[0]) or 1
    n_tokens = window_tokens if window_tokens is not None else int(mask.sum().item())
    if loss_type == "grpo":
        seq_lens = mask.sum(dim=1).clamp(min=1.0)
        loss = ((per_token * mask).sum(dim=1) / seq_lens).sum() / n_seqs
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / max(n_tokens, 1)
    elif loss_type == "dr_grpo":
        if max_completion_len is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_len")
        loss = (per_token * mask).sum() / (n_seqs * max_completion_len)
    else:
        raise ValueError(f"loss_type must be 'grpo', 'dapo' or 'dr_grpo', got {loss_type!r}")

    with torch.no_grad():
        count = mask.sum().clamp(min=1.0)
        clip_low = ((ratio < 1.0 - eps_low) & (adv < 0)).to(mask.dtype)
        clip_high = ((ratio > 1.0 + eps_high) & (adv > 0)).to(mask.dtype)
        stats = {
            "clip_frac_low": ((clip_low * mask).sum() / count).item(),
            "clip_frac_high": ((clip_high * mask).sum() / count).item(),
            "ratio_mean": ((ratio * mask).sum() / count).item(),
            "kl": ((kl * mask).sum() / count).item() if kl is not None else 0.0,
            "tokens": mask.sum().item(),
        }
    return loss, stats
