"""Sampling with a shared prefill: a prompt repeated within a generate call is encoded once and its KV cache
copied to its rows. The sampled distribution must not change: the same per-step logits as the plain path
(float tolerance), and with a fixed seed the same completions."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer

import cpu
import forwards
import prompts
import rollout
from forwards import cache_kwarg, hoist_common_prefix
from rollout import generate_completions, shared_prefill

QUESTIONS = ["What is 2 + 5?", "Tom has 12 apples and gets 3 more in total today. How many apples now?", "Is 7 odd?"]


def group_prompts(tokenizer, group_size: int) -> list[str]:
    """Prompts of different lengths (so rows are left-padded differently), each repeated G times."""
    texts = [prompts.render_prompt(tokenizer, prompts.problem_request(q), True) for q in QUESTIONS]
    return [t for t in texts for _ in range(group_size)]


def encoded_groups(tokenizer, group_size: int):
    """The distinct prompts encoded once, each output row's distinct prompt, and the rows' ids and mask."""
    chunk = group_prompts(tokenizer, group_size)
    distinct = list(dict.fromkeys(chunk))
    rows = [distinct.index(t) for t in chunk]
    enc = tokenizer(distinct, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc, rows, enc.input_ids[rows], enc.attention_mask[rows]


@pytest.mark.parametrize("group_size", [1, 4])
def test_shared_prefill_gives_the_plain_paths_logits_at_every_step(tiny, group_size):
    """Groups of 4 share the common prefix and each prompt; distinct prompts (G = 1) the prefix only."""
    model, tokenizer = tiny
    model.eval()
    enc, rows, ids, mask = encoded_groups(tokenizer, group_size)
    assert hoist_common_prefix(enc.input_ids, enc.attention_mask, enc.input_ids.shape[1])[2] > 10  # the template
    settings = dict(do_sample=False, max_new_tokens=10, output_logits=True, return_dict_in_generate=True,
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=[], min_new_tokens=10)
    plain = model.generate(input_ids=ids, attention_mask=mask, **settings)
    shared_ids, shared_mask, cache = shared_prefill(model, enc.input_ids, enc.attention_mask, rows)
    shared = model.generate(input_ids=shared_ids, attention_mask=shared_mask, **settings, **{cache_kwarg(): cache})
    generated = shared.sequences[:, ids.shape[1]:]
    shared = type(shared)(sequences=torch.cat([ids, generated], dim=1), logits=shared.logits)
    assert torch.equal(plain.sequences, shared.sequences)
    assert len(plain.logits) == len(shared.logits) == 10
    for step, (a, b) in enumerate(zip(plain.logits, shared.logits)):
        torch.testing.assert_close(a.log_softmax(-1), b.log_softmax(-1), atol=1e-5, rtol=1e-5,
                                   msg=lambda m, step=step: f"step {step}: {m}")


def test_shared_prefill_logits_differ_when_cache_rows_are_misassigned(tiny):
    """The check above can fail: the same comparison with the cache rows of two prompts swapped."""
    model, tokenizer = tiny
    model.eval()
    enc, rows, ids, mask = encoded_groups(tokenizer, 2)
    settings = dict(do_sample=False, max_new_tokens=1, output_logits=True, return_dict_in_generate=True,
                    pad_token_id=tokenizer.pad_token_id)
    plain = model.generate(input_ids=ids, attention_mask=mask, **settings)
    wrong = [1 - r if r < 2 else r for r in rows]
    _, _, cache = shared_prefill(model, enc.input_ids, enc.attention_mask, wrong)
    hoisted = shared_prefill(model, enc.input_ids, enc.attention_mask, rows)[:2]
    swapped = model.generate(input_ids=hoisted[0], attention_mask=hoisted[1], **settings, **{cache_kwarg(): cache})
    assert not torch.allclose(plain.logits[0][:4], swapped.logits[0][:4], atol=1e-3)


@pytest.mark.parametrize("greedy", [False, True])
def test_shared_prefill_samples_the_same_completions(tiny, greedy):
    """Fixed seed: the same completions (ids, prompt ids, truncation) with and without sharing, including a
    group split across two generate calls and a prompt that appears once."""
    model, tokenizer = tiny
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    texts = group_prompts(tokenizer, 4) + [prompts.render_prompt(tokenizer, "Say Yes or No.", False)]
    for seed in range(3):
        outs = []
        for share in (False, True):
            torch.manual_seed(seed)
            outs.append(generate_completions(model, tokenizer, texts, eos_ids=eos, max_new_tokens=12, greedy=greedy,
                                             batch_size=6, share_prefill=share))
        for i, (a, b) in enumerate(zip(*outs)):
            assert a.prompt_ids.tolist() == b.prompt_ids.tolist(), i
            assert a.completion_ids.tolist() == b.completion_ids.tolist(), (seed, i)
            assert (a.truncated, a.text) == (b.truncated, b.text)


@pytest.mark.parametrize("room", [10, 4])
def test_reserved_cache_gives_the_dynamic_caches_logits_bit_for_bit(tiny, room):
    """Keys and values written into room kept behind the prompt's cache: the same tokens and the same logits,
    bit for bit, as DynamicCache's concatenation. With room for every new token the buffers are allocated once
    (by generate()'s first forward, after the prefill's row copies) and every later step writes in place; with
    less room they grow, and the logits are the same still."""
    model, tokenizer = tiny
    model.eval()
    enc, rows, _, _ = encoded_groups(tokenizer, 2)
    settings = dict(do_sample=False, max_new_tokens=10, output_logits=True, return_dict_in_generate=True,
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=[], min_new_tokens=10)
    outs, layers = [], []
    for reserve in (0, room):
        ids, mask, cache = shared_prefill(model, enc.input_ids, enc.attention_mask, rows, reserve)
        assert all(type(layer) is (rollout.ReservedLayer if reserve else DynamicLayer) for layer in cache.layers)
        outs.append(model.generate(input_ids=ids, attention_mask=mask, **settings, **{cache_kwarg(): cache}))
        layers.append(cache.layers)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for step, (a, b) in enumerate(zip(outs[0].logits, outs[1].logits)):
        assert torch.equal(a, b), step
    for plain, reserved in zip(*layers):
        assert torch.equal(plain.keys, reserved.keys) and torch.equal(plain.values, reserved.values)
        length = ids.shape[1] + 9  # the prompt and the tokens fed back (the 10th is sampled, not fed)
        assert reserved.keys.shape[-2] == length and reserved.keys.data_ptr() == reserved._buffers[0].data_ptr()
        if room == 10:  # allocated once, at the prompt's length + room: no copy after the first decoding step
            assert reserved._buffers[0].shape[-2] == ids.shape[1] + room
        else:
            assert reserved._buffers[0].shape[-2] >= length


def test_generate_completions_decodes_into_reserved_room(tiny, monkeypatch):
    """generate_completions keeps room for its longest limit (shared prefill or not) and samples what the
    DynamicCache path samples, fixed seed; a call with the plain cache patched in is the reference."""
    model, tokenizer = tiny
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    texts = group_prompts(tokenizer, 2) + [prompts.render_prompt(tokenizer, "Say Yes or No.", False)]
    rooms = []
    real = rollout.reserved_cache
    monkeypatch.setattr(rollout, "reserved_cache", lambda room: rooms.append(room) or real(room))
    for share in (True, False):
        outs = []
        for patched in (False, True):
            if patched:
                monkeypatch.setattr(rollout, "reserved_cache", lambda room: real(0))
            torch.manual_seed(0)
            outs.append(generate_completions(model, tokenizer, texts, eos_ids=eos, max_new_tokens=[9] * 6 + [14],
                                             greedy=[False] * 6 + [True], batch_size=4, share_prefill=share))
            monkeypatch.setattr(rollout, "reserved_cache", lambda room: rooms.append(room) or real(room))
        for i, (a, b) in enumerate(zip(*outs)):
            assert a.completion_ids.tolist() == b.completion_ids.tolist(), (share, i)
    assert rooms == [9, 14, 9, 14]  # per call (4 prompts, then 3), shared or not: its own longest limit


def test_greedy_rows_and_row_limits_inside_one_sampling_call(tiny):
    """Per-row settings: greedy rows in a sampling call decode exactly as a greedy-only call, and every row
    stops at its own limit (its truncation judged within that limit)."""
    model, tokenizer = tiny
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    sampled = group_prompts(tokenizer, 2)
    asks = [prompts.render_prompt(tokenizer, q, False) for q in ("Say Yes or No.", "Check each step.")]
    torch.manual_seed(0)
    alone = generate_completions(model, tokenizer, asks, eos_ids=eos, max_new_tokens=12, greedy=True)
    torch.manual_seed(0)
    mixed = generate_completions(model, tokenizer, sampled + asks, eos_ids=eos,
                                 max_new_tokens=[3] * len(sampled) + [12] * len(asks),
                                 greedy=[False] * len(sampled) + [True] * len(asks))
    for a, b in zip(alone, mixed[len(sampled):]):
        assert a.completion_ids.tolist() == b.completion_ids.tolist() and a.truncated == b.truncated
    assert max(len(c.completion_ids) for c in mixed[len(sampled):]) > 3
    for c in mixed[:len(sampled)]:
        assert len(c.completion_ids) <= 3
        assert c.truncated == (eos[0] not in c.completion_ids.tolist())
    with pytest.raises(ValueError, match="2 greedy flags"):
        generate_completions(model, tokenizer, asks + asks, eos_ids=eos, max_new_tokens=4, greedy=[True, False])


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampling_draws_what_generates_own_warpers_draw(tiny, top_p):
    """Temperature and top-p moved into _TemperedSampling: with one seed, the same tokens as generate() given
    temperature and top_p itself (the draws did not change when the sampler began recording log-probs)."""
    model, tokenizer = tiny
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    chunk = group_prompts(tokenizer, 3)
    enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(5)
    hf = model.generate(**enc, do_sample=True, temperature=0.7, top_p=top_p, top_k=0, max_new_tokens=10,
                        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, repetition_penalty=1.0)
    torch.manual_seed(5)
    ours = generate_completions(model, tokenizer, chunk, eos_ids=eos, max_new_tokens=10, temperature=0.7,
                                top_p=top_p, share_prefill=False)
    for row, c in zip(hf[:, enc.input_ids.shape[1]:], ours):
        assert row[:len(c.completion_ids)].tolist() == c.completion_ids.tolist()


@pytest.mark.parametrize("share_prefill", [False, True])
def test_sampler_logprobs_are_the_updates_logprobs_of_the_drawn_tokens(tiny, share_prefill):
    """Each sampled token's recorded log-prob is log_softmax(logits / T) of that token, what the update's
    forward computes (forwards.token_logprobs): same weights, fp32, so equal to float rounding. Top-p does not
    enter it (it is the tempered distribution's, as the update's); greedy rows in the call get none."""
    model, tokenizer = tiny
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    sampled = group_prompts(tokenizer, 2)
    torch.manual_seed(3)
    outs = generate_completions(model, tokenizer, sampled + sampled[:1], eos_ids=eos, max_new_tokens=12,
                                temperature=0.7, top_p=0.9, greedy=[False] * len(sampled) + [True],
                                share_prefill=share_prefill)
    ids, attn, cmask = rollout.pack(outs[:len(sampled)], tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        trainer = forwards.token_logprobs(model, ids, attn, cmask, micro_batch=8, temperature=0.7)[0]
    for row, c in enumerate(outs[:len(sampled)]):
        assert c.sampler_logps.shape == c.completion_ids.shape and (c.sampler_logps <= 0).all()
        torch.testing.assert_close(c.sampler_logps, trainer[row, :len(c.completion_ids)], atol=2e-5, rtol=0)
    assert sum(len(c.completion_ids) for c in outs[:len(sampled)]) > 2 * len(sampled)
    greedy_only = generate_completions(model, tokenizer, sampled[:1], eos_ids=eos, max_new_tokens=4, greedy=True)
    assert greedy_only[0].sampler_logps is None


# ------------------------------------------------------------------ rows-first linear layers (CPU decoding)

@pytest.mark.parametrize("rows", [1, 2, 3, 64])
def test_rows_first_linear_matches_nn_linear_on_few_rows(rows):
    """W·xᵀ gives x·Wᵀ + b to float rounding, for 3-d inputs (batch, positions, features), bias included."""

    torch.manual_seed(rows)
    plain = torch.nn.Linear(40, 300)
    fast = torch.nn.Linear(40, 300)
    fast.load_state_dict(plain.state_dict())
    assert cpu.rows_first_linears(torch.nn.Sequential(fast)) == 1
    x = torch.randn(rows, 1, 40) if rows < 64 else torch.randn(16, 4, 40)
    with torch.no_grad():
        expected, got = plain(x), fast(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, torch.nn.functional.linear(x, plain.weight), atol=1e-3)  # the bias is added


def test_rows_first_linear_leaves_training_and_large_forwards_bit_for_bit(monkeypatch):
    """Grad enabled (the update), more rows than max_rows (prefill), bf16 weights: nn.Linear's own path,
    exactly; a forward on few rows without grad takes the other path (its summation order shows in the bits)."""

    torch.manual_seed(0)
    layer = torch.nn.Linear(576, 2000, bias=False)
    reference = layer.weight.detach().clone()
    cpu.rows_first_linears(torch.nn.Sequential(layer))
    few = torch.randn(3, 576)
    assert not torch.equal(few @ reference.T, (reference @ few.T).T)  # the two paths can be told apart
    assert torch.equal(layer(few), few @ reference.T)  # grad enabled
    with torch.no_grad():
        assert torch.equal(layer(few), (reference @ few.T).T)
        monkeypatch.setattr(cpu.RowsFirstLinear, "max_rows", 2)
        assert torch.equal(layer(few), few @ reference.T)
        half = torch.nn.Linear(576, 8, bias=False).to(torch.bfloat16)
        cpu.rows_first_linears(half)
        assert torch.equal(half(few.bfloat16()), torch.nn.functional.linear(few.bfloat16(), half.weight))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_low_precision_lm_head_reads_its_input_contiguous(tiny_model_dir, dtype):
    """logits_to_keep=1 hands the head a strided slice (the last position of each row): in bf16 speed_up (with
    or without rows-first) makes it contiguous before the product, once however often it is called, and the
    logits are the head's product on that copy; fp32 inputs reach the head as they come (their path kept bit
    for bit)."""
    import models

    model = models.load_policy(str(tiny_model_dir), dtype).eval()
    cpu.speed_up(model, rows_first=False)
    cpu.speed_up(model, rows_first=False)
    head = model.get_output_embeddings()
    assert len(head._forward_pre_hooks) == 1
    seen = []
    head.register_forward_pre_hook(lambda module, args: seen.append(args[0]))  # runs after speed_up's hook
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        logits = model(input_ids=ids, logits_to_keep=1).logits
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    assert seen[0].shape == (2, 1, hidden.shape[-1]) and seen[0].is_contiguous() == (dtype == torch.bfloat16)
    assert torch.equal(logits, torch.nn.functional.linear(hidden[:, -1:].contiguous(), head.weight))


def test_rows_first_linears_sample_the_same_completions(tiny_model_dir):
    """Fixed seed: the same sampled and greedy completions with every linear layer rows-first, and each
    decoding step's log-probs within float tolerance of the plain model's."""
    import models

    tokenizer = models.load_tokenizer(str(tiny_model_dir))
    plain = models.load_policy(str(tiny_model_dir), torch.float32).eval()
    fast = models.load_policy(str(tiny_model_dir), torch.float32).eval()
    linears = sum(type(m) is torch.nn.Linear for m in fast.modules())
    assert cpu.rows_first_linears(fast) == linears == 2 * 7 + 1  # q k v o gate up down per layer, LM head
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    texts = group_prompts(tokenizer, 2)
    for greedy in (False, True):
        outs = []
        for model in (plain, fast):
            torch.manual_seed(0)
            outs.append(generate_completions(model, tokenizer, texts, eos_ids=eos, max_new_tokens=12, greedy=greedy))
        assert [a.completion_ids.tolist() for a in outs[0]] == [b.completion_ids.tolist() for b in outs[1]]
    settings = dict(do_sample=False, max_new_tokens=8, min_new_tokens=8, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=[])
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    a, b = (m.generate(**enc, **settings) for m in (plain, fast))
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x.log_softmax(-1), y.log_softmax(-1), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ compiled decoding (--compile-decoding)


def test_compiled_decoding_gives_the_eager_logits_at_every_step(tiny_model_dir):
    """A static cache filled by the shared prefill, decoded by the compiled step: the same greedy tokens and
    each step's log-probs within float tolerance of the eager DynamicCache path. Compiling again for the same
    shapes costs nothing: the second call builds no graph."""
    import models

    tokenizer = models.load_tokenizer(str(tiny_model_dir))
    model = models.load_policy(str(tiny_model_dir), torch.float32).eval()
    enc, rows, _, _ = encoded_groups(tokenizer, 2)
    settings = dict(do_sample=False, max_new_tokens=10, min_new_tokens=10, output_logits=True, eos_token_id=[],
                    return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    ids, mask, cache = shared_prefill(model, enc.input_ids, enc.attention_mask, rows)
    eager = model.generate(input_ids=ids, attention_mask=mask, **settings, **{cache_kwarg(): cache})
    before = rollout.compiling_stats()
    for call in range(2):
        ids, mask, cache = shared_prefill(model, enc.input_ids, enc.attention_mask, rows)
        static = rollout.static_cache(model, ids.shape[1] + 10, cache)
        assert int(static.get_seq_length()) == ids.shape[1] - 1  # generate() runs the last prompt token only
        compiled = model.generate(input_ids=ids, attention_mask=mask, **settings, **{cache_kwarg(): static},
                                  compile_config=rollout.decoding_compile_config(ids.device))
        assert torch.equal(eager.sequences, compiled.sequences)
        for step, (a, b) in enumerate(zip(eager.logits, compiled.logits)):
            torch.testing.assert_close(a.log_softmax(-1), b.log_softmax(-1), atol=1e-5, rtol=1e-5,
                                       msg=lambda m, step=step: f"step {step}: {m}")
        after = rollout.compiling_stats()
        if call == 0:
            assert after["compiled_graphs"] == before["compiled_graphs"] + 1
            assert after["compile_s"] > before["compile_s"]
            first = after
    assert after == first  # the second call compiled nothing


def test_compiled_decoding_samples_the_same_completions(tiny_model_dir):
    """Fixed seed: generate_completions with compiled=True returns the eager path's completions (ids, prompt,
    truncation), sampled and greedy rows mixed in one call with per-row limits, with and without prefill
    sharing, over two calls of different sizes."""
    import models

    tokenizer = models.load_tokenizer(str(tiny_model_dir))
    model = models.load_policy(str(tiny_model_dir), torch.float32).eval()
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    asks = [prompts.render_prompt(tokenizer, q, False) for q in ("Say Yes or No.", "Check each step.")]
    texts = group_prompts(tokenizer, 2) + asks
    greedy, limits = [False] * 6 + [True] * 2, [6] * 6 + [12] * 2
    for share in (True, False):
        outs = []
        for compiled in (False, True):
            torch.manual_seed(0)
            outs.append(generate_completions(model, tokenizer, texts, eos_ids=eos, max_new_tokens=limits,
                                             greedy=greedy, batch_size=5, share_prefill=share, compiled=compiled))
        for i, (a, b) in enumerate(zip(*outs)):
            assert a.prompt_ids.tolist() == b.prompt_ids.tolist(), i
            assert a.completion_ids.tolist() == b.completion_ids.tolist(), (share, i)
            assert (a.truncated, a.text) == (b.truncated, b.text)
        assert max(len(c.completion_ids) for c in outs[1][6:]) > 6  # the greedy rows ran past the sampled ones


def test_compile_decoding_trains_on_the_same_rollouts_and_logs_its_compiles(tiny_model_dir, tmp_path):
    """A whole run with --compile-decoding (sampling, principles, held-out evaluation all compiled): the same
    pool of trials as the eager run, and the compiled graphs logged every step; steps with the shapes of an
    earlier one compile nothing new."""
    import json

    import config
    import lanpo

    runs = {}
    for flags in ((), ("--compile-decoding",)):
        out = tmp_path / ("compiled" if flags else "eager")
        lanpo.main(config.parse_config([
            "--model", str(tiny_model_dir), "--out-dir", str(out), "--steps", "4", "--batch-problems", "2",
            "--group-size", "4", "--micro-batch", "4", "--max-new-tokens", "8", "--synthetic-size", "2",
            "--eval-every", "2", "--eval-size", "2", "--relevance-threshold", "0", "--abstract-max-tokens", "8",
            "--feedback", "both", "--feedback-ratio", "0.5", "--report-to", "none", "--lr", "1e-2", *flags]))
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        pool = [json.loads(line) for line in (out / "checkpoints" / "step-000004" / "pool.jsonl").read_text()
                .splitlines()]
        runs[bool(flags)] = records, [(t["problem_id"], t["kind"], t["response"]) for t in pool]
    (eager, eager_pool), (compiled, compiled_pool) = runs[False], runs[True]
    assert compiled_pool == eager_pool
    assert all("compiled_graphs" not in r for r in eager)
    graphs = [r["compiled_graphs"] for r in compiled]
    assert graphs[0] >= 1 and graphs == sorted(graphs) and compiled[-1]["compile_s"] > 0
    assert graphs[3] == graphs[2]  # step 4 repeats step 3's shapes (sampling, principles from cache, eval)
