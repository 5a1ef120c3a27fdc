"""Sampling with Hugging Face `generate` and packing (prompt, completion) pairs into training tensors.

Shared by training, evaluation and abstraction, so every path samples and scores text the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicLayer

from forwards import cache_kwarg, hoist_common_prefix, position_ids
from grpo import completion_mask


@dataclass
class Completion:
    prompt_ids: torch.Tensor      # [P_i] prompt tokens, no padding
    completion_ids: torch.Tensor  # [C_i] generated tokens up to and including the first EOS
    truncated: bool               # no EOS within max_new_tokens
    text: str                     # decoded completion, special tokens dropped
    sampler_logps: torch.Tensor | None = None  # [C_i] each token's log-prob at the sampling temperature, as the
    #                                            sampler computed it (sampled calls only)


def reserved_cache(room: int):
    """An empty DynamicCache whose layers keep room for `room` more tokens behind their keys and values
    (`ReservedLayer`): what a generate() call of `room` new tokens grows its cache by. A plain DynamicCache
    for room 0 (a prefill with no decoding after it)."""
    cache = DynamicCache()
    if room:
        cache.layer_class_to_replicate = lambda: ReservedLayer(room)
    return cache


class ReservedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers with `room` more tokens behind them: a
    decoding step writes its token's keys and values into that room, where DynamicLayer concatenates,
    copying the whole cache every token (O(length) a token: 10 % of a 4-row SmolLM2 decoding step at 330
    cached tokens in a CPU profile; a LANPO sampling call 0.96x, bench/kv_room.py). The attention reads the
    same values, so its outputs are the same bit for bit. Whatever replaces the keys (batch_select_indices,
    crop) ends the views: the next update copies them into new buffers, with `room` again."""

    def __init__(self, room: int):
        super().__init__()
        self.room, self._buffers, self._view = room, None, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        length = key_states.shape[-2] + self.get_seq_length()
        if self._buffers is None or self._buffers[0].shape[-2] < length or self.keys is not self._view:
            keys, values = super().update(key_states, value_states, *args, **kwargs)  # concatenates
            shape = (*keys.shape[:-2], length + self.room, keys.shape[-1])
            self._buffers = (keys.new_empty(shape), values.new_empty(shape))
        else:
            keys, values = key_states, value_states
        start = length - keys.shape[-2]
        self._buffers[0][..., start:length, :] = keys
        self._buffers[1][..., start:length, :] = values
        self.keys, self.values = self._buffers[0][..., :length, :], self._buffers[1][..., :length, :]
        self._view = self.keys
        return self.keys, self.values


@torch.no_grad()
def shared_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[int], room: int = 0):
    """Prefill each distinct prompt once and copy its KV cache to every row that repeats it.

    input_ids/attention_mask hold the distinct prompts, left-padded; `rows[i]` is the distinct prompt of
    output row i. The prefix every prompt starts with (the chat template's system turn and worked example)
    is moved in front of the padding (`forwards.hoist_common_prefix`) and encoded once; then each prompt's rest
    but its last token, once. generate() still runs the last prompt token itself and samples the first
    completion token from logits it computed, exactly as without a cache. Positions count real tokens
    only, as generate() numbers them. Returns the output rows' input_ids and attention_mask, and the cache,
    which keeps room for `room` more tokens a row (`reserved_cache`) where the caller decodes that many."""
    ids, mask, prefix = hoist_common_prefix(input_ids, attention_mask, input_ids.shape[1])
    positions, name = position_ids(mask), cache_kwarg()
    cache = reserved_cache(room)
    if prefix:
        model(input_ids=ids[:1, :prefix], attention_mask=mask[:1, :prefix], position_ids=positions[:1, :prefix],
              use_cache=True, logits_to_keep=1, **{name: cache})
        cache.batch_select_indices(torch.zeros(len(ids), dtype=torch.long, device=ids.device))
    model(input_ids=ids[:, prefix:-1], attention_mask=mask[:, :-1], position_ids=positions[:, prefix:-1],
          use_cache=True, logits_to_keep=1, **{name: cache})
    index = torch.tensor(rows, device=ids.device)
    cache.batch_select_indices(index)
    return ids[index], mask[index], cache


# The compiled decoding step's KV cache is this many tokens long, rounded up: a call with a longer prompt or
# limit within the same block reuses the compiled step instead of tracing a new cache length.
STATIC_CACHE_BLOCK = 256


def static_cache(model, length: int, filled=None):
    """A StaticCache of up to `length` tokens a row (rounded up to STATIC_CACHE_BLOCK), holding the keys and
    values of `filled` (a DynamicCache from `shared_prefill`; the prompts' are written by generate()'s prefill
    when it is empty or None).
    Its tensors keep their place in memory, which is what lets the decoding step be compiled (and captured in
    a CUDA graph)."""
    from transformers import StaticCache

    length = -(-length // STATIC_CACHE_BLOCK) * STATIC_CACHE_BLOCK
    cache = StaticCache(config=model.config, max_cache_len=length)
    for i, layer in enumerate(filled.layers if filled is not None else []):
        cache.update(layer.keys, layer.values, i)
    return cache


def compiling_stats() -> dict[str, float]:
    """Graphs torch.compile has built in this process so far and the seconds it spent building them (a new
    batch size or cache length makes a new one): the cost of --compile-decoding, logged with every step."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {"compiled_graphs": float(counters["stats"]["unique_graphs"]),
            "compile_s": float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))}


def decoding_compile_config(device):
    """transformers' compile settings for generate(): CUDA graphs of the decoding step on GPU ("reduce-overhead"),
    inductor's C++ kernels elsewhere (generate() compiles only on accelerators unless told to)."""
    from transformers import CompileConfig

    config = CompileConfig(mode="reduce-overhead" if device.type == "cuda" else "default")
    config._compile_all_devices = device.type != "cuda"
    return config


class _TemperedSampling(LogitsProcessor):
    """Logits processor that does generate()'s temperature and top-p itself (the same operations in the same
    order, with transformers' own top-p warper, so the draws are the same) and records each sampled token's
    log-prob under the tempered distribution before top-p, log_softmax(logits / T): what the update computes
    for the token (forwards.token_logprobs), here from the sampler's own forward. A call's token is known at
    the next call (the last column of input_ids); `logprobs` adds the last one."""

    def __init__(self, temperature: float, top_p: float):
        from transformers import TopPLogitsWarper

        self.temperature = temperature
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1.0 else None
        self.previous, self.picked = None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.picked.append(self.previous.gather(1, input_ids[:, -1:]))
        scores = scores / self.temperature
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return self.top_p(input_ids, scores) if self.top_p is not None else scores

    def logprobs(self, generated: torch.Tensor) -> torch.Tensor:
        """[rows, tokens] log-probs of `generated` (the call's new tokens, one column per processor call)."""
        last = [self.previous.gather(1, generated[:, -1:])] if self.previous is not None else []
        return torch.cat(self.picked + last, dim=1)


class _ArgmaxRows(LogitsProcessor):
    """Logits processor: the marked rows keep only their argmax, so a sampling call decodes them greedily."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        best = scores[self.rows].argmax(dim=-1, keepdim=True)
        scores[self.rows] = torch.full_like(scores[self.rows], float("-inf")).scatter(-1, best, 0.0)
        return scores


class _RowLimits(StoppingCriteria):
    """Stopping criterion: each row stops after its own number of new tokens."""

    def __init__(self, prompt_len: int, limits: list[int]):
        self.prompt_len, self.limits = prompt_len, limits

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.tensor(self.limits, device=input_ids.device) <= input_ids.shape[1] - self.prompt_len


@torch.no_grad()
def generate_completions(model, tokenizer, prompts: list[str], *, eos_ids: list[int], max_new_tokens: int | list[int],
                         temperature: float = 1.0, top_p: float = 1.0, greedy: bool | list[bool] = False,
                         batch_size: int = 64, share_prefill: bool = True, compiled: bool = False,
                         progress: str = "") -> list[Completion]:
    """One completion per prompt (repeat a prompt G times for G samples), in batched generate calls of
    `batch_size` prompts, left-padded. Sampling draws from torch's global RNG: seed it for reproducibility.

    greedy and max_new_tokens may be given per prompt (lists): greedy rows take the argmax inside a sampling
    call and every row stops at its own limit, so work with different settings shares one call (LANPO's
    principles ride along with the rollouts under --abstract-ahead).

    share_prefill: the prefix all prompts of a call share is encoded once, and so is a prompt repeated within
    the call (the G samples of a group); their KV cache is copied to the rows (`shared_prefill`), instead of
    each row encoding its own copy. The sampled distribution is the same; the logits may differ in the last
    float bits, as with any change of batch shape.

    compiled: decode with a static KV cache (`static_cache`) and the decoding step compiled by torch.compile
    (transformers' own support in generate(); the prefill stays eager). Per-row greedy and limits and prefill
    sharing work as without; the logits agree to float rounding. Each new batch size or cache length compiles
    once more (`compiling_stats`); the first call pays seconds (tiny models) to minutes.

    progress: a label for a progress bar over the prompts (stderr), advanced after each generate call."""
    from tqdm.auto import tqdm

    n = len(prompts)
    greedy_rows = list(greedy) if isinstance(greedy, (list, tuple)) else [greedy] * n
    limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * n
    if len(greedy_rows) != n or len(limits) != n:
        raise ValueError(f"{n} prompts but {len(greedy_rows)} greedy flags and {len(limits)} token limits")
    was_training = model.training
    model.eval()
    results: list[Completion] = []
    bar = tqdm(total=n, desc=progress, unit="prompt", leave=False, disable=not progress)
    for start in range(0, n, batch_size):
        chunk = prompts[start:start + batch_size]
        chunk_greedy, chunk_limits = greedy_rows[start:start + batch_size], limits[start:start + batch_size]
        distinct = list(dict.fromkeys(chunk))
        enc = tokenizer(distinct if share_prefill else chunk, return_tensors="pt", padding=True,
                        add_special_tokens=False).to(model.device)
        # eager decoding writes each token into room kept behind the prompt's cache; the static cache has its own
        room = 0 if compiled else max(chunk_limits)
        input_ids, attention_mask = enc.input_ids, enc.attention_mask
        if share_prefill and input_ids.shape[1] > 1:
            position = {text: i for i, text in enumerate(distinct)}
            input_ids, attention_mask, kv = shared_prefill(model, input_ids, attention_mask,
                                                           [position[text] for text in chunk], room)
        else:
            kv = reserved_cache(room)
        cache = {cache_kwarg(): kv}
        if compiled:
            length = input_ids.shape[1] + max(chunk_limits)
            cache = {cache_kwarg(): static_cache(model, length, kv),
                     "compile_config": decoding_compile_config(input_ids.device)}
        tempered = None
        if all(chunk_greedy):
            sampling = {"do_sample": False}
        else:  # temperature and top-p are _TemperedSampling's: generate()'s own are switched off (1.0)
            tempered = _TemperedSampling(temperature, top_p)
            sampling = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                        "logits_processor": LogitsProcessorList([tempered])}
            if any(chunk_greedy):
                sampling["logits_processor"].append(_ArgmaxRows(torch.tensor(chunk_greedy, device=input_ids.device)))
        if len(set(chunk_limits)) > 1:
            sampling["stopping_criteria"] = StoppingCriteriaList([_RowLimits(input_ids.shape[1], chunk_limits)])
        # top_k=0 and repetition_penalty=1 override generation_config defaults (top_k=50; Qwen-Instruct's
        # 1.05 penalty) that would make the sampled distribution differ from the one we score and train.
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **cache, **sampling,
                             max_new_tokens=max(chunk_limits), eos_token_id=eos_ids,
                             pad_token_id=tokenizer.pad_token_id, use_cache=True, repetition_penalty=1.0)
        generated = out[:, input_ids.shape[1]:]
        logps = tempered.logprobs(generated) if tempered is not None and generated.shape[1] else None
        if generated.shape[1] == 0:
            generated = torch.full((len(chunk), 1), tokenizer.pad_token_id, device=out.device)
        for row in range(len(chunk)):
            # a row past its own limit holds padding, which may be an EOS id: mask within the limit only
            mask, truncated = completion_mask(generated[row:row + 1, :chunk_limits[row]], eos_ids)
            prompt_ids = input_ids[row][attention_mask[row].bool()].cpu()
            kept = mask[0].bool()
            completion_ids = generated[row, :chunk_limits[row]][kept].cpu()
            results.append(Completion(prompt_ids, completion_ids, bool(truncated[0]),
                                      tokenizer.decode(completion_ids, skip_special_tokens=True),
                                      None if logps is None else logps[row, :chunk_limits[row]][kept].cpu()))
        bar.update(len(chunk))
    bar.close()
    model.train(was_training)
    return results


def token_ids(tokenizer, text: str) -> torch.Tensor:
    """A rendered prompt's token ids, as generate_completions encodes it (its special tokens are in the text)."""
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)


def pack(completions: list[Completion], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[left-padded prompt | right-padded completion] rows: input_ids, attention_mask [N, P+C] and
    completion_mask [N, C]. Every completion starts at column P, which token_logprobs relies on."""
    P = max(len(c.prompt_ids) for c in completions)
    C = max(max(len(c.completion_ids) for c in completions), 1)
    n = len(completions)
    input_ids = torch.full((n, P + C), pad_id, dtype=torch.long)
    attention = torch.zeros((n, P + C), dtype=torch.long)
    cmask = torch.zeros((n, C), dtype=torch.long)
    for i, c in enumerate(completions):
        p, k = len(c.prompt_ids), len(c.completion_ids)
        input_ids[i, P - p:P] = c.prompt_ids
        input_ids[i, P:P + k] = c.completion_ids
        attention[i, P - p:P + k] = 1
        cmask[i, :k] = 1
    return input_ids.to(device), attention.to(device), cmask.to(device)
