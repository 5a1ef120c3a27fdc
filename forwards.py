"""The policy's forward passes over [left-padded prompt | completion] rows, done with as little compute as the
same result allows: only the completion positions through the LM head, rows in groups of similar completion
length (`length_chunks`), a prompt repeated across rows encoded once with its KV cache shared
(`shared_prompt_logits`), and per-token log-probs one sequence at a time (`selective_log_softmax`). The same
log-probs and gradient as one plain padded forward, up to float rounding (tests/test_grpo.py). grpo.py holds
the maths these feed; rollout.py and abstract.py use the position and cache helpers.
"""

from __future__ import annotations

import functools
import inspect

import torch


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


def _longest_first(lengths: torch.Tensor) -> list[int]:
    """The lengths sorted longest first, an empty one counted as 1 (a forward computes at least one position)."""
    return sorted((max(int(n), 1) for n in lengths.tolist()), reverse=True)


def chunk_count(lengths: torch.Tensor, most: int, price: float | None = None) -> int:
    """How many groups of similar completion length the update's forward over these rows should take, at most
    `most`: each group beyond the first must save `price` padded positions, by default CHUNK_MIN_SAVING of the
    padded rectangle."""
    size = _longest_first(lengths)
    costs, _ = _least_padded_splits(size, min(most, len(size)))
    price = CHUNK_MIN_SAVING * len(size) * size[0] if price is None else price
    best = min(range(len(costs)), key=lambda j: costs[j] + j * price)
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
                      temperature: float = 1.0, share_prompts: bool = False, chunks: int = 1,
                      prompt_chunks: int = 1) -> torch.Tensor:
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
    own copy. The same function of the weights, gradient included, up to float rounding; less compute.
    prompt_chunks: the distinct prompts go through the model in exactly that many forwards over column ranges
    (`prompt_chunk_count` says how many pay); the same rule for collective forwards as `chunks`."""
    groups = length_chunks(attention_mask[:, -n_completion:].sum(dim=1), chunks)
    if share_prompts:
        parts = shared_prompt_logits(model, input_ids, attention_mask, n_completion, groups, prompt_chunks)
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


def distinct_prompts(ids: torch.Tensor, mask: torch.Tensor, k: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For hoisted rows (`hoist_common_prefix`, prefix k): each row's distinct prompt (by its columns k..split,
    the rest without its last token) and the first row of each distinct prompt."""
    key = torch.cat([ids[:, k:split], mask[:, k:split]], dim=1)
    _, prompt_of = torch.unique(key, dim=0, return_inverse=True)
    order = torch.arange(len(prompt_of), device=prompt_of.device)
    first = torch.full((int(prompt_of.max()) + 1,), len(prompt_of), device=prompt_of.device).scatter_reduce(
        0, prompt_of, order, "amin")
    return prompt_of, first


def prompt_chunk_count(input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int, most: int) -> int:
    """How many forwards over column ranges the distinct prompts of these rows should take in forward (2) of
    `shared_prompt_logits`, at most `most`: `chunk_count` of their lengths after the shared prefix, an extra
    forward priced as one over the completions (CHUNK_MIN_SAVING of the rows x the completions' width: a
    forward's fixed cost does not shrink with the few distinct prompts it runs)."""
    split = input_ids.shape[1] - n_completion - 1
    ids, mask, k = hoist_common_prefix(input_ids, attention_mask, split + 1)
    if k < 1:
        return 1
    _, first = distinct_prompts(ids, mask, k, split)
    return chunk_count(mask[first, k:split].sum(dim=1), most, CHUNK_MIN_SAVING * len(ids) * n_completion)


def prompt_column_cuts(lengths: torch.Tensor, width: int, ranges: int) -> list[int]:
    """Where forward (2)'s `ranges` column ranges over a region of `width` columns begin and end (0, ..., width):
    prompts are left-padded, so a prompt of length n takes part in every range that ends after column width - n.
    The cuts sit where the least padded split of the lengths into `ranges` groups (`_least_padded_splits`) puts
    them; ranges are at least one column wide (width >= ranges), the widest halved while there are too few."""
    size = _longest_first(lengths)
    _, ends = _least_padded_splits(size, min(ranges, len(size)))
    cuts = sorted({0, width, *(width - size[end] for end in ends[:-1])})
    while len(cuts) < ranges + 1:
        i = max(range(len(cuts) - 1), key=lambda j: cuts[j + 1] - cuts[j])
        cuts.insert(i + 1, (cuts[i] + cuts[i + 1]) // 2)
    return cuts


def shared_prompt_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                         groups: list[tuple[torch.Tensor, int]], prompt_chunks: int = 1) -> list[torch.Tensor]:
    """`completion_logits` as a prefix tree: (1) the prefix every prompt of the batch starts with (the chat
    template's system turn and worked example), once; (2) the rest of each distinct prompt without its last
    token, once per distinct prompt, attending to (1), in `prompt_chunks` forwards over consecutive column
    ranges (`prompt_column_cuts`), each over the prompts with tokens in its columns, so that short prompts are
    not padded to the longest; (3) for each group of rows (`length_chunks`), every row's last prompt token and
    completion up to the group's width, attending to its prompt's cache. The cache's rows are copied by
    indexing, so the gradient of every copy flows back into the forward that made it. The number of forwards,
    1 + prompt_chunks + len(groups), depends on the counts only, whatever repeats, so that processes whose
    forwards are collective (ZeRO-3) make the same calls. Returns each group's logits [rows, width, V]."""
    from transformers import DynamicCache
    split = input_ids.shape[1] - n_completion - 1  # columns before each row's last prompt token
    if torch.is_grad_enabled() and model.training and any(
            getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ValueError("gradient checkpointing runs layers without their KV cache: prompts cannot be shared")
    ids, mask, k = hoist_common_prefix(input_ids, attention_mask, split + 1)
    if k < 1:
        raise ValueError("sharing prompts in the update needs prompts that start alike (a chat template) and "
                         "have at least 3 tokens: use --no-share-prompt-forward")
    # every range at least one column wide: where the rests are narrower than that, the prefix gives back its
    # last columns (the same tokens in every row, which the first range then computes for each prompt)
    k = min(k, split - prompt_chunks)
    if k < 1:
        raise ValueError(f"{prompt_chunks} forwards over the prompts need prompts of at least "
                         f"{prompt_chunks + 2} tokens: lower --update-chunks or use --no-share-prompt-forward")
    prompt_of, first = distinct_prompts(ids, mask, k, split)
    cuts = [k + c for c in prompt_column_cuts(mask[first, k:split].sum(dim=1), split - k, prompt_chunks)]
    positions, name = position_ids(mask), cache_kwarg()
    cache = DynamicCache()
    model(input_ids=ids[:1, :k], attention_mask=mask[:1, :k], position_ids=positions[:1, :k], use_cache=True,
          logits_to_keep=1, **{name: cache})
    n = len(first)
    prompt_kv = [(layer[0].expand(n, -1, -1, -1), layer[1].expand(n, -1, -1, -1)) for layer in cache]
    for start, end in zip(cuts[:-1], cuts[1:]):
        rows = mask[first, start:end].any(dim=1).nonzero().squeeze(1)  # the prompts with tokens in these columns
        part = DynamicCache()
        for i, (keys, values) in enumerate(prompt_kv):
            part.update(keys[rows], values[rows], i)
        model(input_ids=ids[first[rows], start:end], attention_mask=mask[first[rows], :end],
              position_ids=positions[first[rows], start:end], use_cache=True, logits_to_keep=1, **{name: part})
        new = [(layer[0][:, :, start:], layer[1][:, :, start:]) for layer in part]
        if len(rows) < n:  # the other prompts are padding in these columns: zeros, masked out
            new = [(keys.new_zeros(n, *keys.shape[1:]).index_copy(0, rows, keys),
                    values.new_zeros(n, *values.shape[1:]).index_copy(0, rows, values)) for keys, values in new]
        prompt_kv = [(torch.cat([keys, new_keys], dim=2), torch.cat([values, new_values], dim=2))
                     for (keys, values), (new_keys, new_values) in zip(prompt_kv, new)]
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
                   share_prompts: bool = False, chunks: int = 1,
                   prompt_chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (and entropies) of the completion tokens, at the sampling temperature.

    input_ids is [left-padded prompt | completion], so every row's completion starts at the same column
    P = T - C. Only the C positions that predict completion tokens go through the LM head
    (`logits_to_keep`), in micro-batches of `micro_batch` rows. Masked positions come back as 0.
    Gradients flow when called under grad mode. share_prompts, chunks, prompt_chunks: see `completion_logits`.
    """
    n_completion = completion_mask.shape[1]
    logps, entropies = [], []
    for start in range(0, input_ids.shape[0], micro_batch):
        rows = slice(start, start + micro_batch)
        logits = completion_logits(model, input_ids[rows], attention_mask[rows], n_completion, temperature,
                                   share_prompts, chunks, prompt_chunks)
        lp, ent = selective_log_softmax(logits, input_ids[rows, -n_completion:])
        logps.append(lp)
        entropies.append(ent)
    mask = completion_mask.to(torch.float32)
    return torch.cat(logps) * mask, torch.cat(entropies) * mask
