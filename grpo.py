"""The numerical core of GRPO: advantages, completion masks, per-token log-probs and the clipped policy loss.

Pure functions on tensors (plus the model forwards in `completion_logits`); no loading, no I/O, no config.
"""

from __future__ import annotations

import functools
import inspect

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


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only, as generate() does. A plain forward would otherwise number
    the left padding too, and score a padded row at shifted positions."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def selective_log_softmax(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and entropy per position of `logits` [N, T, V], one row at a time in float32, so the
    float32 full-vocabulary log-softmax never exists for more than one sequence at once."""
    logps, entropies = [], []
    for row_logits, row_targets in zip(logits, targets):
        row = row_logits.float()
        log_norm = torch.logsumexp(row, dim=-1)
        logps.append(row.gather(-1, row_targets[:, None]).squeeze(-1) - log_norm)
        with torch.no_grad():  # entropy is a diagnostic: no graph, freed at once
            probs = torch.softmax(row, dim=-1)
            entropies.append(log_norm - (probs * row).sum(-1))
    return torch.stack(logps), torch.stack(entropies)


@functools.cache
def cache_kwarg() -> str:
    """The name generate() and forward() take a KV cache under: `cache` in newer transformers, where
    `past_key_values` is deprecated; `past_key_values` before."""
    from transformers import GenerationMixin
    return "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters \
        else "past_key_values"


# An extra forward in the update must save at least this share of the micro-batch's padded rectangle (rows x
# longest completion): each costs a fixed amount beside its tokens (its own pass over every weight, and in the
# backward its own full-size weight gradient to add), measured on CPU as 0.98-1.10x the update's time for 2
# groups where they saved 3 % of the positions, 0.67-0.74x where they saved 38 % (bench/update_chunks.py).
CHUNK_MIN_SAVING = 0.1


def _least_padded_splits(size: list[int], most: int) -> tuple[list[float], list[int]]:
    """For the lengths `size` sorted longest first: the fewest padded positions of a contiguous split into j
    groups for each j = 1..most (a group is as wide as its first, longest row), and where each of the `most`
    groups of the best split into `most` ends."""
    n = len(size)
    total = [0]
    for s in size:
        total.append(total[-1] + s)
    inf = float("inf")
    cost = [[inf] * (n + 1) for _ in range(most + 1)]  # cost[j][i]: the first i rows in j groups
    cut = [[0] * (n + 1) for _ in range(most + 1)]
    cost[0][0] = 0
    for j in range(1, most + 1):
        for i in range(j, n + 1):
            for start in range(j - 1, i):
                c = cost[j - 1][start] + (i - start) * size[start] - (total[i] - total[start])
                if c < cost[j][i]:
                    cost[j][i], cut[j][i] = c, start
    ends = [n]
    for j in range(most, 1, -1):
        ends.append(cut[j][ends[-1]])
    return [cost[j][n] for j in range(1, most + 1)], ends[::-1]


def chunk_count(lengths: torch.Tensor, most: int) -> int:
    """How many groups of similar completion length the update's forward over these rows should take, at most
    `most`: each group beyond the first must save CHUNK_MIN_SAVING of the padded rectangle."""
    size = sorted((max(int(n), 1) for n in lengths.tolist()), reverse=True)
    costs, _ = _least_padded_splits(size, min(most, len(size)))
    best = min(range(len(costs)), key=lambda j: costs[j] + j * CHUNK_MIN_SAVING * len(size) * size[0])
    return best + 1


def length_chunks(lengths: torch.Tensor, chunks: int) -> list[tuple[torch.Tensor, int]]:
    """Rows split into exactly min(chunks, rows) groups of similar completion length, each with the longest
    length in it (at least 1): the contiguous split of the rows sorted by length that pads the fewest
    positions (dynamic programming). Each group's rows in their original order."""
    order = torch.argsort(lengths, descending=True, stable=True)
    size = [max(int(n), 1) for n in lengths[order].tolist()]
    _, ends = _least_padded_splits(size, min(chunks, len(size)))
    return [(order[a:b].sort().values, size[a]) for a, b in zip([0, *ends[:-1]], ends)]


def completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                      temperature: float = 1.0, share_prompts: bool = False, chunks: int = 1) -> torch.Tensor:
    """Logits [N, C, V] at the C positions that predict the completion tokens of [left-padded prompt |
    completion] rows, divided by the sampling temperature (the sampled distribution was softmax(logits / T)).
    Right padding past the longest completion of a row's group (below) holds 0; callers mask padding anyway.

    chunks: the rows go through the model in exactly that many groups of similar completion length
    (`length_chunks`; `chunk_count` says how many pay), each cut at its own longest completion, so that short
    completions do not pay for the longest one's padding. The same logits up to float rounding. The number
    of forwards depends on `chunks` only: processes whose forwards are collective (ZeRO-3, FSDP) pass the
    same number.

    share_prompts: the prefix all prompts share goes through the model once, every distinct prompt once, and
    the rows' completions attend to their KV cache (`shared_prompt_logits`), instead of each row encoding its
    own copy. The same function of the weights, gradient included, up to float rounding; less compute."""
    groups = length_chunks(attention_mask[:, -n_completion:].sum(dim=1), chunks)
    if share_prompts:
        parts = shared_prompt_logits(model, input_ids, attention_mask, n_completion, groups)
    else:
        n_prompt = input_ids.shape[1] - n_completion
        parts = []
        for rows, width in groups:  # a row's last prompt token and its first width - 1 completion tokens
            ids, mask = input_ids[rows, :n_prompt + width - 1], attention_mask[rows, :n_prompt + width - 1]
            parts.append(model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                               logits_to_keep=width).logits)
    if len(groups) == 1 and groups[0][1] == n_completion:  # all rows, in order, full width
        logits = parts[0]
    else:
        logits = parts[0].new_zeros(input_ids.shape[0], n_completion, parts[0].shape[-1])
        for (rows, width), part in zip(groups, parts):
            logits[rows, :width] = part
    return logits / temperature if temperature != 1.0 else logits


def hoist_common_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        n_prompt: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """[left pad | prompt | completion] rows -> [prefix every prompt starts with | pad | rest of the prompt |
    completion], and the prefix length k. The prefix is capped so that every prompt keeps at least one token
    after it and the last prompt token stays in column n_prompt - 1. Positions counted over real tokens
    (`position_ids`) are unchanged, so the rows mean the same to the model; the prefix now sits in the same
    columns of every row, where one forward can serve all of them."""
    lengths = attention_mask[:, :n_prompt].sum(dim=1)
    shortest = int(lengths.min())
    starts = n_prompt - lengths
    heads = input_ids.gather(1, starts[:, None] + torch.arange(shortest - 1, device=input_ids.device))
    differs = (heads != heads[:1]).any(dim=0).tolist() + [True]
    k = min(differs.index(True), n_prompt - 2)
    if k < 1:
        return input_ids, attention_mask, 0
    ids, mask = input_ids.clone(), attention_mask.clone()
    for row, start in enumerate(starts.tolist()):  # move the row's left padding from before its prefix to after it
        ids[row, :k], ids[row, k:start + k] = input_ids[row, start:start + k], input_ids[row, :start]
        mask[row, :k], mask[row, k:start + k] = 1, 0
    return ids, mask, k


def shared_prompt_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                         groups: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """`completion_logits` as a prefix tree: (1) the prefix every prompt of the batch starts with (the chat
    template's system turn and worked example), once; (2) the rest of each distinct prompt without its last
    token, once per distinct prompt, attending to (1); (3) for each group of rows (`length_chunks`), every
    row's last prompt token and completion up to the group's width, attending to its prompt's cache. The
    cache's rows are copied by indexing, so the gradient of every copy flows back into the forward that made
    it. The number of forwards depends on the groups only, whatever repeats, so that processes whose forwards
    are collective (ZeRO-3) make the same calls. Returns each group's logits [rows, width, V]."""
    from transformers import DynamicCache
    split = input_ids.shape[1] - n_completion - 1  # columns before each row's last prompt token
    if torch.is_grad_enabled() and model.training and any(
            getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ValueError("gradient checkpointing runs layers without their KV cache: prompts cannot be shared")
    ids, mask, k = hoist_common_prefix(input_ids, attention_mask, split + 1)
    if k < 1:
        raise ValueError("sharing prompts in the update needs prompts that start alike (a chat template) and "
                         "have at least 3 tokens: use --no-share-prompt-forward")
    positions, name = position_ids(mask), cache_kwarg()
    key = torch.cat([ids[:, k:split], mask[:, k:split]], dim=1)
    _, prompt_of = torch.unique(key, dim=0, return_inverse=True)
    order = torch.arange(len(prompt_of), device=prompt_of.device)
    first = torch.full((int(prompt_of.max()) + 1,), len(prompt_of), device=prompt_of.device).scatter_reduce(
        0, prompt_of, order, "amin")
    cache = DynamicCache()
    model(input_ids=ids[:1, :k], attention_mask=mask[:1, :k], position_ids=positions[:1, :k], use_cache=True,
          logits_to_keep=1, **{name: cache})
    cache.batch_select_indices(torch.zeros_like(first))
    model(input_ids=ids[first, k:split], attention_mask=mask[first, :split], position_ids=positions[first, k:split],
          use_cache=True, logits_to_keep=1, **{name: cache})
    prompt_kv = [(layer[0], layer[1]) for layer in cache]  # per layer: keys, values of each distinct prompt
    parts = []
    for rows, width in groups:
        rows_cache = DynamicCache()
        for i, (keys, values) in enumerate(prompt_kv):
            rows_cache.update(keys[prompt_of[rows]], values[prompt_of[rows]], i)
        end = split + width  # the last prompt token and the first width - 1 completion tokens
        parts.append(model(input_ids=ids[rows, split:end], attention_mask=mask[rows, :end],
                           position_ids=positions[rows, split:end], use_cache=True, logits_to_keep=width,
                           **{name: rows_cache}).logits)
    return parts


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
                   micro_batch: int, temperature: float = 1.0,
                   share_prompts: bool = False, chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (and entropies) of the completion tokens, at the sampling temperature.

    input_ids is [left-padded prompt | completion], so every row's completion starts at the same column
    P = T - C. Only the C positions that predict completion tokens go through the LM head
    (`logits_to_keep`), in micro-batches of `micro_batch` rows. Masked positions come back as 0.
    Gradients flow when called under grad mode. share_prompts, chunks: see `completion_logits`.
    """
    n_completion = completion_mask.shape[1]
    logps, entropies = [], []
    for start in range(0, input_ids.shape[0], micro_batch):
        rows = slice(start, start + micro_batch)
        logits = completion_logits(model, input_ids[rows], attention_mask[rows], n_completion, temperature,
                                   share_prompts, chunks)
        lp, ent = selective_log_softmax(logits, input_ids[rows, -n_completion:])
        logps.append(lp)
        entropies.append(ent)
    mask = completion_mask.to(torch.float32)
    return torch.cat(logps) * mask, torch.cat(entropies) * mask


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
