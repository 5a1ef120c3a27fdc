"""grpo.py: advantages, masks, log-probs and the loss against numbers worked by hand, plus properties."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import forwards
import grpo
from rollout import Completion, pack


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    std = math.sqrt(1 / 3)  # sample std of [1, 0, 0, 1]
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + grpo.ADV_EPS)
    adv = grpo.group_advantages(r, 4, "group")
    assert torch.allclose(adv[:4], expected) and torch.equal(adv[4:], torch.zeros(4))
    assert torch.allclose(grpo.group_advantages(r, 4, "none"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    batch_std = math.sqrt((2 * 0.75**2 + 6 * 0.25**2) / 7)
    assert torch.allclose(grpo.group_advantages(r, 4, "batch")[:4],
                          torch.tensor([0.5, -0.5, -0.5, 0.5]) / (batch_std + grpo.ADV_EPS))
    assert torch.equal(grpo.group_advantages(r, 4), adv)  # the default scale is the group's std
    assert torch.equal(grpo.group_advantages(r, 1), torch.zeros(8))  # a group of one: no spread, no NaN
    pairs = grpo.group_advantages(torch.tensor([1.0, 0.0]), 2)  # G = 2: sample std of (1, 0) is 1/sqrt(2)
    half = 0.5 / (math.sqrt(0.5) + grpo.ADV_EPS)
    assert pairs.tolist() == pytest.approx([half, -half])
    with pytest.raises(ValueError, match=r"1-D with a multiple of group_size=3 items, got shape \(8,\)"):
        grpo.group_advantages(r, 3)
    with pytest.raises(ValueError, match="scale must be 'group', 'batch' or 'none', got 'std'"):
        grpo.group_advantages(r, 4, "std")


def test_completion_mask_includes_first_eos_only():
    ids = torch.tensor([[5, 2, 7, 2], [5, 5, 5, 5], [2, 0, 0, 0], [7, 2, 2, 2]])
    mask, truncated = grpo.completion_mask(ids, [2])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert truncated.tolist() == [False, True, False, False]
    mask, truncated = grpo.completion_mask(ids, [2, 7])  # every EOS id of the model counts
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]]


def _loss(logps, old, adv, mask, **kw):
    return grpo.policy_loss(torch.tensor(logps), torch.tensor(old), torch.tensor(adv), torch.tensor(mask), **kw)


def test_loss_types_by_hand():
    # ratio 1 everywhere: token loss = -A. Seq 1: two tokens of -1; seq 2: three tokens of +0.5.
    lp, mask, adv = [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], [[1, 1, 0], [1, 1, 1]], [1.0, -0.5]
    assert _loss(lp, lp, adv, mask, loss_type="grpo")[0].item() == pytest.approx((-1 + 0.5) / 2)
    assert _loss(lp, lp, adv, mask, loss_type="dapo")[0].item() == pytest.approx((-2 + 1.5) / 5)
    assert _loss(lp, lp, adv, mask, loss_type="dr_grpo", max_completion_len=4)[0].item() == pytest.approx(-0.5 / 8)
    # accumulation window: a micro-batch holding seq 1 of the 2-sequence, 5-token window
    dapo = _loss(lp[:1], lp[:1], adv[:1], mask[:1], loss_type="dapo", window_tokens=5)[0]
    assert dapo.item() == pytest.approx(-2 / 5)
    assert _loss(lp[:1], lp[:1], adv[:1], mask[:1], loss_type="grpo", window_seqs=2)[0].item() == pytest.approx(-1 / 2)


def test_clipping_by_hand():
    up, down = math.log(1.5), math.log(0.5)
    loss, s = _loss([[up]], [[0.0]], [1.0], [[1]], eps_high=0.2)
    assert loss.item() == pytest.approx(-1.2) and s["clip_frac_high"] == 1.0 and s["clip_frac_low"] == 0.0
    loss, s = _loss([[up]], [[0.0]], [1.0], [[1]], eps_high=0.28)  # clip-higher: asymmetric bound
    assert loss.item() == pytest.approx(-1.28)
    loss, s = _loss([[up]], [[0.0]], [-1.0], [[1]])  # pessimistic side: not clipped
    assert loss.item() == pytest.approx(1.5) and s["clip_frac_high"] == 0.0
    loss, s = _loss([[down]], [[0.0]], [-1.0], [[1]], eps_low=0.2)
    assert loss.item() == pytest.approx(0.8) and s["clip_frac_low"] == 1.0
    assert s["ratio_mean"] == pytest.approx(0.5)


def test_clip_and_kl_statistics_by_hand():
    """Each token's clip side, counted over unmasked tokens only: ratios 0.5, 0.8 (on the low bound: not
    clipped), 1.5, 1.2 (on the high bound) and 0.5, 1.5 at a masked position, advantages of each sign and 0
    (never clipped). Default bounds: 0.2 either side."""
    lp = [[math.log(0.5), math.log(0.8), math.log(1.5)], [math.log(1.2), math.log(0.5), math.log(1.5)],
          [math.log(0.5), math.log(1.5), 0.0]]
    mask, adv = [[1, 1, 1], [1, 1, 0], [1, 1, 0]], [-1.0, 1.0, 0.0]
    zeros = [[0.0] * 3] * 3
    _, s = _loss(lp, zeros, adv, mask)
    # row 0 (A < 0): 0.5 clipped low; 0.8 on the bound; 1.5 not (pessimistic side). Row 1 (A > 0): 1.2 on the
    # bound, 0.5 not, 1.5 masked. Row 2 (A = 0): nothing. 7 tokens.
    assert s["clip_frac_low"] == pytest.approx(1 / 7) and s["clip_frac_high"] == 0.0 and s["tokens"] == 7
    _, s = _loss(lp, zeros, [1.0, 1.0, 1.0], mask)  # every row's 1.5 counts where unmasked: rows 0 and 2
    assert s["clip_frac_high"] == pytest.approx(2 / 7) and s["clip_frac_low"] == 0.0
    loss, _ = _loss([[math.log(3.0)]], [[0.0]], [1.0], [[1]])  # the default upper bound is 1.2
    assert loss.item() == pytest.approx(-1.2)
    loss, _ = _loss([[math.log(0.1)]], [[0.0]], [-1.0], [[1]])  # the default lower bound is 0.8
    assert loss.item() == pytest.approx(0.8)
    # KL: per token k3 with ref = logp + log 2 on the unmasked tokens, log 3 on the masked one
    ref = torch.tensor([[math.log(2.0), math.log(2.0)], [math.log(2.0), math.log(3.0)]])
    _, s = _loss([[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0], [[1, 1], [1, 0]], ref_logps=ref,
                 beta=0.1)
    assert s["kl"] == pytest.approx(1 - math.log(2))
    assert _loss([[0.0]], [[0.0]], [1.0], [[1]])[1]["kl"] == 0.0  # no KL term: 0


def test_policy_loss_messages():
    with pytest.raises(ValueError, match="^beta > 0 needs ref_logps$"):
        _loss([[0.0]], [[0.0]], [0.0], [[1]], beta=0.1)
    with pytest.raises(ValueError, match="^loss_type='dr_grpo' needs max_completion_len$"):
        _loss([[0.0]], [[0.0]], [0.0], [[1]], loss_type="dr_grpo")
    with pytest.raises(ValueError, match="^loss_type must be 'grpo', 'dapo' or 'dr_grpo', got 'ppo'$"):
        _loss([[0.0]], [[0.0]], [0.0], [[1]], loss_type="ppo")


def test_k3_kl_by_hand():
    loss, s = _loss([[0.0]], [[0.0]], [0.0], [[1]], ref_logps=torch.tensor([[math.log(2.0)]]), beta=0.1)
    assert s["kl"] == pytest.approx(1 - math.log(2))
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)))
    with pytest.raises(ValueError):
        _loss([[0.0]], [[0.0]], [0.0], [[1]], beta=0.1)


def test_k3_gradient_with_ratio_is_unbiased_kl_gradient():
    # Exact expectation over a 3-token vocabulary: sum_x pi_old(x) * grad[(pi/pi_old) k3(x)] == grad KL(pi||ref)
    theta = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.1, 0.4, -0.3]), 0)
    logp = torch.log_softmax(theta, 0)
    old = logp.detach()
    total = 0
    for x in range(3):
        loss, _ = grpo.policy_loss(logp[x].view(1, 1), old[x].view(1, 1), torch.zeros(1), torch.ones(1, 1),
                                   ref[x].view(1, 1), beta=1.0)
        total = total + old[x].exp() * loss
    (g_est,) = torch.autograd.grad(total, theta)
    logp = torch.log_softmax(theta, 0)
    kl = (logp.exp() * (logp - ref)).sum()
    (g_true,) = torch.autograd.grad(kl, theta)
    assert torch.allclose(g_est, g_true, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_padding_changes_neither_loss_nor_gradient(loss_type):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        n, c = 3, 6
        mask = (torch.rand(n, c, generator=g) < 0.7).long()
        mask[:, 0] = 1
        base = torch.randn(n, c, generator=g)
        old = torch.randn(n, c, generator=g) * 0.1 + base
        ref, adv = torch.randn(n, c, generator=g), torch.randn(n, generator=g)
        noise = torch.randn(n, c, generator=g) * 5 * (1 - mask)
        results = []
        for lp_values, old_values, ref_values in ((base, old, ref), (base + noise, old - noise, ref + noise)):
            lp = lp_values.clone().requires_grad_(True)
            loss, _ = grpo.policy_loss(lp, old_values, adv, mask, ref_values, beta=0.05, loss_type=loss_type,
                                       max_completion_len=c)
            loss.backward()
            results.append((loss.detach(), lp.grad * mask))
        assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
        assert torch.allclose(results[0][1], results[1][1], atol=1e-6)


def test_on_policy_gradient_is_advantage_weighted_reinforce():
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.randn(3, generator=g)
    lp = torch.randn(3, 4, generator=g).requires_grad_(True)
    loss, _ = grpo.policy_loss(lp, lp.detach(), adv, mask, loss_type="grpo")
    loss.backward()
    # d/dlogp of -mean_i mean_t A_i * exp(logp - sg(logp)) = -A_i / (|o_i| * N)
    expected = -adv[:, None] / mask.sum(1, keepdim=True) / 3 * mask
    assert torch.allclose(lp.grad, expected, atol=1e-7)


def test_token_logprobs_match_naive_and_ignore_left_padding(tiny):
    model, tokenizer = tiny
    torch.manual_seed(0)
    comps = [Completion(torch.randint(3, 300, (p,)), torch.randint(3, 300, (k,)), False, "")
             for p, k in ((5, 4), (9, 2), (3, 6))]
    ids, attn, cmask = pack(comps, tokenizer.pad_token_id, "cpu")
    for temperature in (1.0, 0.7):
        with torch.no_grad():
            got, entropy = forwards.token_logprobs(model, ids, attn, cmask, micro_batch=2, temperature=temperature)
        for i, c in enumerate(comps):
            full = torch.cat([c.prompt_ids, c.completion_ids])[None]
            with torch.no_grad():
                logits = model(full).logits[0, len(c.prompt_ids) - 1:-1] / temperature
            naive = torch.log_softmax(logits.float(), -1).gather(-1, c.completion_ids[:, None]).squeeze(-1)
            k = len(c.completion_ids)
            assert torch.allclose(got[i, :k], naive, atol=1e-5), (i, temperature)
            assert torch.all(got[i, k:] == 0) and torch.all(entropy[i, k:] == 0) and torch.all(entropy[i, :k] > 0)
            probs = torch.softmax(logits.float(), -1)
            assert torch.allclose(entropy[i, :k], -(probs * probs.log()).sum(-1), atol=1e-4)


def test_hoist_common_prefix_by_hand():
    pad = 0
    ids = torch.tensor([[pad, pad, 7, 8, 9, 4, 51],    # prompt 7 8 9 4, completion 51
                        [7, 8, 9, 5, 6, 3, 52],        # prompt 7 8 9 5 6 3
                        [pad, pad, pad, 7, 8, 6, 53]])  # prompt 7 8 6
    mask = (ids != pad).long()
    hoisted, hoisted_mask, k = forwards.hoist_common_prefix(ids, mask, n_prompt=6)
    assert k == 2  # 7 8 is every prompt's start
    assert hoisted.tolist() == [[7, 8, pad, pad, 9, 4, 51], [7, 8, 9, 5, 6, 3, 52], [7, 8, pad, pad, pad, 6, 53]]
    assert hoisted_mask.tolist() == [[1, 1, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 1, 1]]
    # the same real-token positions, so the same sequences to the model
    for row in range(3):
        assert (forwards.position_ids(hoisted_mask)[row][hoisted_mask[row].bool()].tolist()
                == forwards.position_ids(mask)[row][mask[row].bool()].tolist())
    # identical prompts keep their last token after the prefix; nothing in common gives k = 0
    same = torch.tensor([[7, 8, 9, 51], [7, 8, 9, 52]])
    assert forwards.hoist_common_prefix(same, torch.ones_like(same), n_prompt=3)[2] == 1
    assert forwards.hoist_common_prefix(ids[:, 2:], mask[:, 2:], n_prompt=4)[2] == 0


def repeated_prompt_batch(tokenizer):
    """Three prompts of different lengths that start alike (as a chat template makes them), repeated 3, 2
    and 1 times, with completions of different lengths: rows that share a prompt are left-padded alike,
    and one prompt repeats nowhere."""
    g = torch.Generator().manual_seed(3)
    template = torch.randint(3, 300, (5,), generator=g)
    prompts = [torch.cat([template, torch.randint(3, 300, (p,), generator=g)]) for p in (6, 11, 2)]
    comps = [Completion(prompts[i], torch.randint(3, 300, (k,), generator=g), False, "")
             for i, k in ((0, 4), (1, 2), (0, 6), (2, 5), (1, 6), (0, 1))]
    return pack(comps, tokenizer.pad_token_id, "cpu")


def logits_and_gradients(model, ids, attn, cmask, share: bool, chunks: int = 1, reference: bool = False,
                         prompt_chunks: int = 1):
    """The completion logits and the gradient of a weighted sum of the completion log-probs. reference: one
    forward over the whole padded rows, logits of the positions before each completion token, by hand."""
    model.zero_grad(set_to_none=True)
    if reference:
        logits = model(input_ids=ids, attention_mask=attn, position_ids=forwards.position_ids(attn)).logits
        logits = logits[:, ids.shape[1] - cmask.shape[1] - 1:-1] / 0.7
    else:
        logits = forwards.completion_logits(model, ids, attn, cmask.shape[1], 0.7, share_prompts=share, chunks=chunks,
                                            prompt_chunks=prompt_chunks)
    logps, _ = forwards.selective_log_softmax(logits, ids[:, -cmask.shape[1]:])
    weights = torch.linspace(-1.0, 2.0, logps.numel()).view_as(logps)
    (logps * cmask * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)  # the model is shared by the session's tests
    return logits.detach(), grads


# prompt chunks: the distinct prompts' rests (after the 5-token template, without the last token) are 5, 10 and 1
# tokens wide; 3 ranges cut them at 5 and 9, 8 halve the widest ranges, 12 take 2 columns back from the template
@pytest.mark.parametrize("share, chunks, prompt_chunks", [(False, 1, 1), (True, 1, 1), (False, 3, 1), (True, 3, 1),
                                                          (True, 6, 1), (True, 10, 1), (True, 1, 3), (True, 3, 2),
                                                          (True, 1, 8), (True, 2, 12)])
def test_shared_and_chunked_forwards_give_the_plain_logits_and_gradients(tiny, share, chunks, prompt_chunks):
    """Prompt sharing and length groups (of completions, and of prompts by column ranges) change which
    positions are computed, not the function: the completion logits and the gradient equal one forward over
    the whole padded rows."""
    model, tokenizer = tiny
    model.train()
    ids, attn, cmask = repeated_prompt_batch(tokenizer)
    plain_logits, plain_grads = logits_and_gradients(model, ids, attn, cmask, share=False, reference=True)
    shared_logits, shared_grads = logits_and_gradients(model, ids, attn, cmask, share=share, chunks=chunks,
                                                       prompt_chunks=prompt_chunks)
    keep = cmask.bool()
    torch.testing.assert_close(shared_logits[keep], plain_logits[keep], atol=1e-5, rtol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-6, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():  # token_logprobs in micro-batches takes the same path
        a = forwards.token_logprobs(model, ids, attn, cmask, micro_batch=4, share_prompts=share, chunks=chunks,
                                    prompt_chunks=prompt_chunks)[0]
        b = forwards.token_logprobs(model, ids, attn, cmask, micro_batch=4)[0]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_prompt_ranges_compute_each_prompt_once_without_padding_it_to_the_longest(tiny):
    """The forwards of the prefix tree, by hand on the batch above: (1) the template, then the distinct prompts'
    rests (5, 10 and 1 tokens before their last) in one forward padded to 10 columns (30 positions), or in the 3
    column ranges prompt_chunk_count picks, each over the prompts with tokens in it: 1 x 5 + 2 x 4 + 3 x 1 = 16,
    no padding; then one forward over the rows' last prompt tokens and completions. Too many ranges for the
    prompts' length is an error that names the flag."""
    model, tokenizer = tiny
    ids, attn, cmask = repeated_prompt_batch(tokenizer)
    # an extra forward must save 0.1 x 6 rows x 6 completion columns = 3.6 positions: one range pads 14, {10} {5 1}
    # 4 + 3.6, {10} {5} {1} 0 + 7.2
    assert forwards.prompt_chunk_count(ids, attn, cmask.shape[1], 4) == 3
    assert forwards.prompt_chunk_count(ids, attn, cmask.shape[1], 2) == 2
    assert forwards.prompt_chunk_count(ids[:1], attn[:1], cmask.shape[1], 4) == 1  # one prompt: nothing to save
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        with torch.no_grad():
            for prompt_chunks in (1, 3):
                shapes.clear()
                forwards.completion_logits(model, ids, attn, cmask.shape[1], share_prompts=True,
                                           prompt_chunks=prompt_chunks)
                assert shapes[0] == (1, 5) and shapes[-1] == (6, 6)  # the template; last prompt token + 5 tokens
                assert shapes[1:-1] == ([(3, 10)] if prompt_chunks == 1 else [(1, 5), (2, 4), (3, 1)])
            with pytest.raises(ValueError, match=r"^15 forwards over the prompts need prompts of at least 17 tokens: "
                                                 r"lower --update-chunks or use --no-share-prompt-forward$"):
                forwards.completion_logits(model, ids, attn, cmask.shape[1], share_prompts=True, prompt_chunks=15)
    finally:
        hook.remove()


def test_prompt_column_cuts_by_hand():
    # lengths 10 5 1 in 10 columns: the least padded split {10} {5} {1} begins its ranges at 0, 10 - 5, 10 - 1
    assert forwards.prompt_column_cuts(torch.tensor([5, 10, 1]), 10, 3) == [0, 5, 9, 10]
    assert forwards.prompt_column_cuts(torch.tensor([5, 10, 1]), 10, 2) == [0, 5, 10]  # {10} {5 1}: pads 4
    assert forwards.prompt_column_cuts(torch.tensor([5, 10, 1]), 10, 1) == [0, 10]
    # more ranges than distinct lengths: the widest range halved, then the first of the widest
    assert forwards.prompt_column_cuts(torch.tensor([8, 8]), 8, 3) == [0, 2, 4, 8]
    assert forwards.prompt_column_cuts(torch.tensor([0, 3]), 3, 3) == [0, 1, 2, 3]  # an empty rest counts as 1


@given(st.lists(st.integers(0, 30), min_size=1, max_size=8), st.integers(1, 6), st.integers(0, 5))
@settings(max_examples=200, deadline=None)
def test_prompt_column_cuts_are_the_least_padded_ranges(lengths, ranges, spare):
    """Exactly `ranges` ranges of at least one column from 0 to the width; where there are as many distinct
    lengths, the positions they compute (a prompt takes part from the range its tokens reach into) are as
    few as the least padded split of the lengths into that many groups."""
    width = max(max(lengths), ranges) + spare
    cuts = forwards.prompt_column_cuts(torch.tensor(lengths), width, ranges)
    assert cuts[0] == 0 and cuts[-1] == width and len(cuts) == ranges + 1
    assert all(a < b for a, b in zip(cuts, cuts[1:]))
    size = [max(n, 1) for n in lengths]
    if len(set(size)) >= ranges and width == max(size):
        computed = sum((b - a) * sum(width - n < b for n in size) for a, b in zip(cuts, cuts[1:]))
        assert computed == forwards._least_padded_splits(sorted(size, reverse=True), ranges)[0][ranges - 1] + sum(size)


def test_length_chunks_pad_least_by_hand():
    rows = lambda groups: [(r.tolist(), w) for r, w in groups]  # noqa: E731
    assert rows(forwards.length_chunks(torch.tensor([1, 8, 1, 8]), 2)) == [([1, 3], 8), ([0, 2], 1)]
    # sorted 6 5 4 2 1 0(->1): {6} {5 4} {2 1 1} pads 0 + 1 + 2, as few as any split into 3
    assert rows(forwards.length_chunks(torch.tensor([5, 1, 4, 0, 6, 2]), 3)) == [([4], 6), ([0, 2], 5), ([1, 3, 5], 2)]
    assert rows(forwards.length_chunks(torch.tensor([3, 7]), 4)) == [([1], 7), ([0], 3)]  # never more groups than rows
    assert rows(forwards.length_chunks(torch.tensor([3, 7, 2]), 1)) == [([0, 1, 2], 7)]


def test_chunk_count_splits_only_where_it_saves_enough():
    # [8 8 1 1]: one forward pads 14 of 32 positions, two pad none; a second forward costs 0.1 x 32 = 3.2
    assert forwards.chunk_count(torch.tensor([8, 1, 8, 1]), 4) == 2
    assert forwards.chunk_count(torch.tensor([8, 1, 8, 1]), 1) == 1
    assert forwards.chunk_count(torch.tensor([5, 5, 4, 5]), 4) == 1  # saves 1 position of 20: not worth a forward
    # a forward beyond the first costs 0.1 x 3 rows x 9 = 2.7 positions. [9 5 1]: one forward pads 12,
    # {9} {5 1} 4 + 2.7, {9} {5} {1} 0 + 5.4 -> three. [9 8 1]: 9, {9 8} {1} 1 + 2.7, three 0 + 5.4 -> two
    assert forwards.chunk_count(torch.tensor([1, 5, 9]), 3) == 3
    assert forwards.chunk_count(torch.tensor([1, 8, 9]), 3) == 2
    assert forwards.chunk_count(torch.tensor([1, 5, 9]), 2) == 2
    # two rows [s0 s1]: a second forward pays off when s0 - s1 > 0.1 x 2 x s0, the longest row's rectangle
    assert forwards.chunk_count(torch.tensor([100, 82]), 2) == 1  # saves 18 < 20
    assert forwards.chunk_count(torch.tensor([100, 79]), 2) == 2  # saves 21 > 20
    assert forwards.chunk_count(torch.tensor([0, 2]), 2) == 2  # an empty completion counts as 1: saves 1 > 0.4
    assert forwards.chunk_count(torch.tensor([100, 79]), 2, price=21.5) == 1  # a given price per extra forward
    assert forwards.chunk_count(torch.tensor([100, 79]), 2, price=20.5) == 2


@given(st.lists(st.integers(0, 40), min_size=1, max_size=9), st.integers(1, 5))
@settings(max_examples=200, deadline=None)
def test_length_chunks_is_the_least_padded_split(lengths, chunks):
    """Every row in exactly one group, min(chunks, rows) groups, each as wide as its longest row, and no
    split of the sorted rows into that many contiguous groups pads fewer positions (brute force)."""
    groups = forwards.length_chunks(torch.tensor(lengths), chunks)
    size = [max(n, 1) for n in lengths]
    assert sorted(i for r, _ in groups for i in r.tolist()) == list(range(len(lengths)))
    assert len(groups) == min(chunks, len(lengths))
    assert all(w == max(size[i] for i in r.tolist()) for r, w in groups)
    padding = sum(w - size[i] for r, w in groups for i in r.tolist())
    ordered = sorted(size, reverse=True)
    best = min(sum(max(ordered[a:b]) * (b - a) - sum(ordered[a:b]) for a, b in zip((0, *cuts), (*cuts, len(size))))
               for cuts in itertools.combinations(range(1, len(size)), len(groups) - 1))
    assert padding == best


def test_shared_prompt_gradient_check_fails_when_copies_do_not_carry_gradient(tiny, monkeypatch):
    """The gradient comparison above can fail: with the cache rows copied into each forward's cache detached
    (a layer's first update), the prompt tokens' share of the gradient is lost and the attention and MLP
    weights' gradients differ."""
    from transformers import DynamicCache

    model, tokenizer = tiny
    model.train()
    ids, attn, cmask = repeated_prompt_batch(tokenizer)
    _, plain_grads = logits_and_gradients(model, ids, attn, cmask, share=False)
    update = DynamicCache.update

    def detached(self, keys, values, layer_idx, *args, **kwargs):
        if len(self.layers) <= layer_idx:
            keys, values = keys.detach(), values.detach()
        return update(self, keys, values, layer_idx, *args, **kwargs)

    monkeypatch.setattr(DynamicCache, "update", detached)
    _, cut_grads = logits_and_gradients(model, ids, attn, cmask, share=True)
    differs = [n for n, g in plain_grads.items() if not torch.allclose(cut_grads[n], g, atol=1e-6, rtol=1e-4)]
    assert any("mlp" in n for n in differs) and any("k_proj" in n for n in differs)


def test_shared_prompt_forward_refuses_gradient_checkpointing(tiny):
    """transformers drops the KV cache of a checkpointed layer under grad: sharing would score completions
    without their prompt, so it stops instead."""
    model, tokenizer = tiny
    ids, attn, cmask = repeated_prompt_batch(tokenizer)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        model.train()
        with pytest.raises(ValueError, match="^gradient checkpointing runs layers without their KV cache: prompts "
                                             "cannot be shared$"):
            forwards.completion_logits(model, ids, attn, cmask.shape[1], share_prompts=True)
        with torch.no_grad():  # without gradient the layers run as they are, cache included
            forwards.completion_logits(model, ids, attn, cmask.shape[1], share_prompts=True)
    finally:  # the model is shared by the session's tests
        model.gradient_checkpointing_disable()


def test_shared_prompt_forward_needs_one_common_token_and_says_so_without(tiny):
    """Prompts that share only their first token still share it (the plain logits), prompts that share
    nothing stop with the flag that turns sharing off."""
    model, tokenizer = tiny
    model.eval()
    one = [Completion(torch.tensor(p), torch.tensor(c), False, "") for p, c in
           (([7, 8, 9, 10], [20, 21]), ([7, 5, 6], [22, 23, 24]), ([7, 11, 12, 13, 14], [25]))]
    ids, attn, cmask = pack(one, tokenizer.pad_token_id, "cpu")
    assert forwards.hoist_common_prefix(ids, attn, ids.shape[1] - cmask.shape[1])[2] == 1
    with torch.no_grad():
        shared = forwards.completion_logits(model, ids, attn, cmask.shape[1], share_prompts=True)
        plain = forwards.completion_logits(model, ids, attn, cmask.shape[1])
    torch.testing.assert_close(shared[cmask.bool()], plain[cmask.bool()], atol=1e-5, rtol=1e-5)
    none = [Completion(torch.tensor(p), torch.tensor([20]), False, "") for p in ([7, 8, 9], [3, 8, 9])]
    ids, attn, cmask = pack(none, tokenizer.pad_token_id, "cpu")
    with pytest.raises(ValueError, match=r"^sharing prompts in the update needs prompts that start alike \(a chat "
                                         r"template\) and have at least 3 tokens: use --no-share-prompt-forward$"):
        forwards.completion_logits(model, ids, attn, cmask.shape[1], share_prompts=True)


@pytest.mark.parametrize("share, chunks", [(False, 1), (True, 1), (False, 3), (True, 3)])
def test_only_the_completion_positions_go_through_the_lm_head(tiny, share, chunks):
    """The LM head (152k columns at 7B: the largest product of a position) sees each row's completion
    positions up to its group's width, plus one position for each forward of the shared prefix tree
    (the common prefix, each distinct prompt's rest), and nothing else."""
    model, tokenizer = tiny
    ids, attn, cmask = repeated_prompt_batch(tokenizer)  # completions 4 2 6 5 6 1 of 3 distinct prompts
    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1].numel()))
    widths = 6 * 6 if chunks == 1 else 2 * 6 + 2 * 5 + 2 * 2  # one group of 6, or {6 6} {5 4} {2 1}
    try:
        with torch.no_grad():
            forwards.completion_logits(model, ids, attn, cmask.shape[1], share_prompts=share, chunks=chunks)
            assert sum(rows) == widths + (1 + 3 if share else 0), rows
            rows.clear()  # token_logprobs passes its settings on (one micro-batch of all 6 rows)
            forwards.token_logprobs(model, ids, attn, cmask, 6, share_prompts=share, chunks=chunks)
            assert sum(rows) == widths + (1 + 3 if share else 0), rows
            rows.clear()  # the defaults: one plain forward
            forwards.completion_logits(model, ids, attn, cmask.shape[1])
            forwards.token_logprobs(model, ids, attn, cmask, 6)
            assert rows == [6 * 6, 6 * 6]
    finally:
        hook.remove()


def test_completion_logits_are_divided_by_the_temperature(tiny):
    """At temperature 1 (the default) the model's own logits, at 2 half of them, at 0.5 twice."""
    model, tokenizer = tiny
    ids, attn, cmask = repeated_prompt_batch(tokenizer)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=attn, position_ids=forwards.position_ids(attn)).logits
        plain = plain[:, ids.shape[1] - cmask.shape[1] - 1:-1]
        keep = cmask.bool()
        for temperature in (None, 2.0, 0.5):
            args = () if temperature is None else (temperature,)
            got = forwards.completion_logits(model, ids, attn, cmask.shape[1], *args)
            torch.testing.assert_close(got[keep], plain[keep] / (temperature or 1.0), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # without gradient the layers run as they are, cache included
        forwards.completion_logits(model, ids, attn, cmask.shape[1], share_prompts=True)
