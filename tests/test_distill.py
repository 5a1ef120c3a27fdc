"""Feedback through the gradient: RLTF-SD advantages and importance weights, feedback modelling and
self-distillation, checked on hand-computed cases, random inputs and end-to-end runs."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import training_metrics
from hypothesis import given, settings
from hypothesis import strategies as st
from test_train import documented_metric_keys

import config
import distill
import forwards
import grpo
import lanpo
from rollout import Completion, pack

P = [0.5, 0.4, 0.1]  # teacher
Q = [0.8, 0.1, 0.1]  # student


def _log(xs):
    return torch.tensor(xs, dtype=torch.float64).log()


def test_divergences_hand_computed():
    forward = 0.5 * math.log(0.5 / 0.8) + 0.4 * math.log(0.4 / 0.1) + 0.1 * math.log(1.0)
    reverse = 0.8 * math.log(0.8 / 0.5) + 0.1 * math.log(0.1 / 0.4) + 0.1 * math.log(1.0)
    m = [(p + q) / 2 for p, q in zip(P, Q)]
    jsd = 0.5 * sum(p * math.log(p / x) for p, x in zip(P, m)) + 0.5 * sum(q * math.log(q / x) for q, x in zip(Q, m))
    assert distill.divergence(_log(Q), _log(P), "forward_kl").item() == pytest.approx(forward, abs=1e-12)
    assert distill.divergence(_log(Q), _log(P), "reverse_kl").item() == pytest.approx(reverse, abs=1e-12)
    assert distill.divergence(_log(Q), _log(P), "jsd").item() == pytest.approx(jsd, abs=1e-12)
    assert forward == pytest.approx(0.319516, abs=1e-6) and reverse == pytest.approx(0.237373, abs=1e-6)
    with pytest.raises(ValueError, match="divergence must be"):
        distill.divergence(_log(Q), _log(P), "kl")


def test_topk_keeps_k_tokens_and_one_bucket_for_the_rest():
    # teacher probabilities 1/2, 1/4, 1/8, 1/8; student 1/8, 1/4, 1/2, 1/8
    teacher = torch.tensor([[[math.log(4), math.log(2), 0.0, 0.0]]])
    student = torch.tensor([[[0.0, math.log(2), math.log(4), 0.0]]])
    t_logps, ids = distill.teacher_logprobs(teacher, top_k=2)
    assert ids.tolist() == [[[0, 1]]]
    assert t_logps.exp()[0, 0].tolist() == pytest.approx([0.5, 0.25, 0.25])
    s_logps = distill.student_logprobs(student, ids)
    assert s_logps.exp()[0, 0].tolist() == pytest.approx([0.125, 0.25, 0.625])
    expected = 0.5 * math.log(0.5 / 0.125) + 0.25 * math.log(1.0) + 0.25 * math.log(0.25 / 0.625)
    assert distill.divergence(s_logps, t_logps, "forward_kl").item() == pytest.approx(expected, abs=1e-6)
    full, none = distill.teacher_logprobs(teacher, top_k=0)
    assert none is None and full.exp()[0, 0].tolist() == pytest.approx([0.5, 0.25, 0.125, 0.125])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 7), scale=st.floats(0.1, 5.0),
       kind=st.sampled_from(["reverse_kl", "forward_kl", "jsd"]))
def test_topk_divergence_is_a_lower_bound_and_exact_at_full_support(seed, k, scale, kind):
    """Merging categories never increases a divergence (data processing), and k = V loses nothing."""
    g = torch.Generator().manual_seed(seed)
    teacher, student = (torch.randn(2, 3, 8, generator=g) * scale for _ in range(2))
    full = distill.divergence(distill.student_logprobs(student, None), distill.teacher_logprobs(teacher, 0)[0], kind)
    t_logps, ids = distill.teacher_logprobs(teacher, k)
    approx = distill.divergence(distill.student_logprobs(student, ids), t_logps, kind)
    assert (approx <= full + 1e-4).all()  # float32: the student's rest bucket is 1 - (its top-k mass)
    t_all, all_ids = distill.teacher_logprobs(teacher, 8)
    assert distill.divergence(distill.student_logprobs(student, all_ids), t_all, kind) == pytest.approx(full, abs=1e-4)


def test_gradients_reach_the_student_only_and_match_the_closed_forms():
    teacher_logits = torch.randn(1, 2, 5, dtype=torch.float64, requires_grad=True)
    student_logits = torch.randn(1, 2, 5, dtype=torch.float64, requires_grad=True)
    t_logps, _ = distill.teacher_logprobs(teacher_logits, top_k=0)
    assert not t_logps.requires_grad  # a stop-gradient target
    q = torch.softmax(student_logits.detach().float(), -1)
    p = t_logps.exp()
    for kind, closed_form in (("forward_kl", lambda: q - p),  # d KL(p || q) / d z = q - p
                              ("reverse_kl", lambda: q * (q.log() - p.log()
                                                          - (q * (q.log() - p.log())).sum(-1, keepdim=True)))):
        student_logits.grad = None
        distill.divergence(distill.student_logprobs(student_logits, None), t_logps, kind).sum().backward()
        assert teacher_logits.grad is None
        assert student_logits.grad.float() == pytest.approx(closed_form(), abs=1e-5)


def test_the_teacher_branch_of_the_shared_model_adds_no_gradient(tiny):
    """As policy_update does it (one model, teacher pass first) equals a teacher from a frozen copy."""
    import copy

    model, tokenizer = tiny
    completion = torch.tensor(tokenizer("The answer is 7.", add_special_tokens=False).input_ids)
    student = Completion(torch.tensor(tokenizer("What is 2 + 5?", add_special_tokens=False).input_ids),
                         completion, False, "")
    teacher = Completion(torch.tensor(tokenizer("Earlier attempt: 7. What is 2 + 5?", add_special_tokens=False)
                                      .input_ids), completion, False, "")
    params = [p for p in model.parameters()]

    def sd_grads(teacher_model):
        t_ids, t_attn, cmask = pack([teacher], tokenizer.pad_token_id, "cpu")
        with torch.no_grad():
            t_logits = forwards.completion_logits(teacher_model, t_ids, t_attn, cmask.shape[1])
            t_logps, top = distill.teacher_logprobs(t_logits, 4)
        ids, attn, cmask = pack([student], tokenizer.pad_token_id, "cpu")
        s_logps = distill.student_logprobs(forwards.completion_logits(model, ids, attn, cmask.shape[1]), top)
        loss = distill.self_distill_loss(s_logps, t_logps, cmask.float(), "reverse_kl", 1.0, cmask.sum().item())[0]
        return loss, torch.autograd.grad(loss, params)

    shared_loss, shared = sd_grads(model)
    frozen_loss, frozen = sd_grads(copy.deepcopy(model).requires_grad_(False))
    assert shared_loss.item() > 0 and shared_loss.item() == pytest.approx(frozen_loss.item())
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(shared, frozen))
    assert any(a.abs().sum() > 0 for a in shared)


def test_a_teacher_equal_to_the_student_gives_zero_loss_and_zero_gradient():
    logits = torch.randn(2, 3, 6, requires_grad=True)
    t_logps, ids = distill.teacher_logprobs(logits, top_k=3)
    for kind in ("reverse_kl", "forward_kl", "jsd"):
        logits.grad = None
        div = distill.divergence(distill.student_logprobs(logits, ids), t_logps, kind)
        div.sum().backward()
        assert div.abs().max().item() < 1e-6 and logits.grad.abs().max().item() < 1e-6


def test_self_distill_loss_hand_computed():
    # two positions: (student Q, teacher P), and one the mask leaves out; the batch has 4 taught tokens
    student = torch.stack([_log(Q), _log(Q)])[None]
    teacher = torch.stack([_log(P), _log(Q)])[None]  # position 2: teacher = student, divergence 0
    reverse = 0.8 * math.log(0.8 / 0.5) + 0.1 * math.log(0.1 / 0.4)
    loss, div = distill.self_distill_loss(student, teacher, torch.tensor([[1.0, 1.0]]), "reverse_kl", 0.5, 4)
    assert loss.item() == pytest.approx(0.5 * reverse / 4) and div[0, 1].item() == pytest.approx(0.0, abs=1e-12)
    masked, _ = distill.self_distill_loss(student, teacher, torch.tensor([[0.0, 1.0]]), "reverse_kl", 0.5, 4)
    assert masked.item() == pytest.approx(0.0, abs=1e-12)


def test_feedback_model_loss_hand_computed():
    # row 1: principle tokens with p = 1/2 and 1/4 (the third column is past its end: 0 from the mask);
    # row 2 is a zero-weight padding copy and must not count
    logps = torch.tensor([[math.log(0.5), math.log(0.25), 0.0], [math.log(0.1), math.log(0.1), math.log(0.1)]])
    loss, nll = distill.feedback_model_loss(logps, torch.tensor([1.0, 0.0]), 0.5, 2)
    assert nll.item() == pytest.approx(3 * math.log(2)) and loss.item() == pytest.approx(0.5 * 3 * math.log(2) / 2)
    # a window below one token a process (one target token over two processes): divided by it, not by 1
    assert distill.feedback_model_loss(logps, torch.tensor([1.0, 0.0]), 0.5, 0.5)[0].item() == pytest.approx(
        0.5 * 3 * math.log(2) / 0.5)


def test_first_turn_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    scratch = torch.tensor([True, True, False, False, True, False, True, False])
    # baselines: mean(1, 0) = 0.5 and mean(0, 1) = 0.5 from the from-scratch rollouts only
    adv = distill.first_turn_advantages(rewards, scratch, 4, "none")
    assert adv.tolist() == [0.5, -0.5, 0.5, 0.5, -0.5, -0.5, 0.5, -0.5]
    # group std (sample): group 1 = std(1, 0, 1, 1) = 0.5, group 2 = std(0, 0, 1, 0) = 0.5
    scaled = distill.first_turn_advantages(rewards, scratch, 4, "group")
    assert scaled.tolist() == pytest.approx([x / (0.5 + grpo.ADV_EPS) for x in adv.tolist()])
    assert distill.first_turn_advantages(rewards, scratch, 4).tolist() == scaled.tolist()  # default: group std
    batch = distill.first_turn_advantages(rewards, scratch, 4, "batch")
    assert batch.tolist() == pytest.approx([x / (rewards.std().item() + grpo.ADV_EPS) for x in adv.tolist()])
    with pytest.raises(ValueError, match=r"group 1 has no from-scratch rollout, so RLTF-SD has no baseline for it; "
                                         r"lower --feedback-ratio so that round\(rho\*G\) < G"):
        distill.first_turn_advantages(rewards, torch.tensor([True] * 4 + [False] * 4), 4)
    with pytest.raises(ValueError, match="scale must be 'group', 'batch' or 'none', got 'std'"):
        distill.first_turn_advantages(rewards, scratch, 4, "std")


@settings(max_examples=30, deadline=None)
@given(rewards=st.lists(st.sampled_from([0.0, 1.0, 0.5]), min_size=8, max_size=8),
       scale=st.sampled_from(["group", "batch", "none"]))
def test_first_turn_advantages_without_feedback_are_grpos(rewards, scale):
    r = torch.tensor(rewards)
    got = distill.first_turn_advantages(r, torch.ones(8, dtype=torch.bool), 4, scale)
    assert got.tolist() == pytest.approx(grpo.group_advantages(r, 4, scale).tolist(), abs=1e-6)


def test_truncated_importance_weights():
    plain, sampling = _log([0.2, 0.9, 0.5]), _log([0.4, 0.3, 0.5])
    assert distill.truncated_is_weights(plain, sampling, 1.0).tolist() == pytest.approx([0.5, 1.0, 1.0])
    assert distill.truncated_is_weights(plain, sampling, 2.0).tolist() == pytest.approx([0.5, 2.0, 1.0])
    assert distill.truncated_is_weights(plain, sampling, 0.0).tolist() == [1.0, 1.0, 1.0]


def test_policy_loss_token_weights():
    logps = torch.zeros(2, 2)
    adv, mask = torch.tensor([1.0, -2.0]), torch.ones(2, 2)
    plain = grpo.policy_loss(logps, logps, adv, mask)[0]
    assert grpo.policy_loss(logps, logps, adv, mask, token_weights=torch.ones(2, 2))[0].item() == plain.item()
    # on-policy ratio 1: token losses -A * w; grpo averages per sequence, then over sequences
    w = torch.tensor([[0.5, 1.0], [0.25, 0.0]])
    expected = (-(1.0 * 0.5 + 1.0 * 1.0) / 2 + (2.0 * 0.25 + 0.0) / 2) / 2
    assert grpo.policy_loss(logps, logps, adv, mask, token_weights=w)[0].item() == pytest.approx(expected)


def test_feedback_model_texts_mask_the_principles_only(tiny):
    model, tokenizer = tiny
    cfg = config.parse_config(["--model", "unused", "--feedback-model-coef", "1", "--group-size", "2",
                               "--micro-batch", "2", "--batch-problems", "2"])
    problems = [{"id": "a", "problem": "What is 2 + 5?", "answer": "7"},
                {"id": "b", "problem": "Tom has 12 apples", "answer": "12"}]
    attempt = Completion(torch.tensor([1]), torch.tensor([2]), False, "2 + 5 = 7")
    other = Completion(torch.tensor([1]), torch.tensor([2]), False, "something else")
    texts = lanpo.feedback_model_texts(tokenizer, problems, {"a": "Check each step."}, [other, attempt, other, other],
                                       ["reflect", "scratch", "scratch", "scratch"], cfg, [0])
    assert len(texts) == 1  # problem b has no principles
    prompt = tokenizer.decode(texts[0].prompt_ids)
    assert "What is 2 + 5?" in prompt and "2 + 5 = 7" in prompt and "something else" not in prompt
    assert "Check each step." not in prompt
    assert texts[0].completion_ids[-1].item() == tokenizer.eos_token_id
    assert tokenizer.decode(texts[0].completion_ids[:-1]) == "Check each step."
    # the loss term: log-likelihood of exactly the principle tokens given the prompt
    ids, attn, cmask = pack(texts, tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        got = forwards.token_logprobs(model, ids, attn, cmask, micro_batch=1)[0].sum().item()
        full = torch.cat([texts[0].prompt_ids, texts[0].completion_ids])[None]
        logp = torch.log_softmax(model(full).logits[0, :-1].float(), -1)
        n_prompt = len(texts[0].prompt_ids)
        by_hand = sum(logp[t - 1, full[0, t]].item() for t in range(n_prompt, full.shape[1]))
    assert got == pytest.approx(by_hand, abs=1e-4)


def test_config_errors_name_the_flag():
    with pytest.raises(SystemExit, match="need from-scratch rollouts"):
        config.parse_config(["--feedback-grad", "distill", "--feedback-ratio", "1"])
    with pytest.raises(SystemExit, match="models the principles text"):
        config.parse_config(["--feedback-model-coef", "1", "--feedback", "reflect"])
    with pytest.raises(SystemExit, match="needs a teacher"):
        config.parse_config(["--self-distill-coef", "1", "--feedback", "none"])
    with pytest.raises(SystemExit, match="--self-distill-topk must be >= 0"):
        config.parse_config(["--self-distill-topk", "-1"])


# ------------------------------------------------------------------------------------------------ end to end

def _run(tiny_model_dir, out, *extra):
    cfg = config.parse_config(["--model", str(tiny_model_dir), "--out-dir", str(out), "--steps", "3",
                               "--batch-problems", "2", "--group-size", "4", "--micro-batch", "4",
                               "--max-new-tokens", "8", "--synthetic-size", "2", "--eval-every", "0",
                               "--relevance-threshold", "0", "--abstract-max-tokens", "8",
                               "--report-to", "none", "--lr", "1e-2", *extra])
    lanpo.main(cfg)
    return training_metrics(out)


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


def test_every_coefficient_at_zero_is_plain_lanpo_exactly(tiny_model_dir, tmp_path, graded_by_parity):
    plain = _run(tiny_model_dir, tmp_path / "plain")
    zero = _run(tiny_model_dir, tmp_path / "zero", "--self-distill-coef", "0", "--feedback-model-coef", "0",
                "--self-distill-div", "jsd", "--self-distill-topk", "0", "--distill-is-cap", "3")
    assert zero == plain
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "zero")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the comparison can fail: a small coefficient changes the run
    tiny_coef = _run(tiny_model_dir, tmp_path / "tiny", "--self-distill-coef", "1e-3")
    c = _weights(tmp_path / "tiny")
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert tiny_coef[0] == plain[0] | {"self_distill_tokens": 0.0}  # step 1: nothing tried yet, no teacher


def test_self_distillation_and_feedback_modelling_log_their_terms(tiny_model_dir, tmp_path, graded_by_parity):
    records = _run(tiny_model_dir, tmp_path / "both", "--self-distill-coef", "1", "--feedback-model-coef", "1",
                   "--self-distill-div", "forward_kl")
    assert "self_distill_div" not in records[0] and records[0]["self_distill_tokens"] == 0
    late = records[2]  # both problems tried before: 4 from-scratch rollouts per step have a teacher
    assert late["self_distill_tokens"] == late["scratch/count"] * late["response_len_mean"] > 0
    assert late["self_distill_div"] > 0
    assert late["self_distill_loss"] == pytest.approx(late["self_distill_div"], rel=1e-5)  # coef 1
    assert late["feedback_model_texts"] == 2 and late["feedback_model_ce"] > 0
    assert late["feedback_model_loss"] == pytest.approx(late["feedback_model_ce"], rel=1e-5)  # coef 1
    documented = documented_metric_keys()
    assert all(set(r) - {"step"} <= documented for r in records), set(late) - documented


def test_distill_trains_feedback_rollouts_on_the_plain_prompt(tiny_model_dir, tmp_path, graded_by_parity):
    records = _run(tiny_model_dir, tmp_path / "distill", "--feedback", "reflect", "--feedback-grad", "distill",
                   "--ppo-epochs", "2")
    assert "distill_is_weight" not in records[0]  # step 1: every rollout from scratch
    assert "distill_is_weight" in records[2]  # its value against a hand computation: test_train.py
    uncapped = _run(tiny_model_dir, tmp_path / "uncorrected", "--feedback", "reflect", "--feedback-grad", "distill",
                    "--ppo-epochs", "2", "--distill-is-cap", "0")
    assert uncapped[2]["distill_is_weight"] == 1.0
    # without any feedback rollout, distill is GRPO: same advantages, same update
    grpo_run = _run(tiny_model_dir, tmp_path / "grpo", "--feedback", "none")
    none = _run(tiny_model_dir, tmp_path / "distill-none", "--feedback", "none", "--feedback-grad", "distill")
    assert [r["loss"] for r in none] == pytest.approx([r["loss"] for r in grpo_run], abs=1e-6)
    assert [r["reward_mean"] for r in none] == [r["reward_mean"] for r in grpo_run]


def test_self_distillation_without_feedback_rollouts(tiny_model_dir, tmp_path, graded_by_parity):
    """--feedback-ratio 0: feedback never enters a rollout's prompt, only the teacher's."""
    records = _run(tiny_model_dir, tmp_path / "sd-only", "--feedback-ratio", "0", "--self-distill-coef", "1",
                   "--self-distill-topk", "0")
    assert all(r["scratch/count"] == 8 for r in records)
    assert records[2]["self_distill_tokens"] == 8 * records[2]["response_len_mean"]  # every rollout taught
    assert records[2]["self_distill_div"] > 0


def test_teacher_eos_probe_builds_the_training_teacher_prompt(tiny, tmp_path):
    """bench/teacher_eos.py must probe the teacher that training builds: for a step-2 from-scratch trial,
    the reflection prompt on the newest step-1 trial, as build_prompts makes it with --self-distill-coef."""
    import importlib.util
    from pathlib import Path

    from pool import ExperiencePool, Trial

    spec = importlib.util.spec_from_file_location("teacher_eos", Path(__file__).parents[1] / "bench" / "teacher_eos.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    _, tokenizer = tiny
    problem = {"id": "p1", "problem": "What is 3 + 4?", "answer": "7"}
    earlier = [Trial("p1", problem["problem"], "scratch", "", "3 + 4 = 8. \\boxed{8}", 0.0, 1),
               Trial("p1", problem["problem"], "scratch", "", "3 + 4 = 7. \\boxed{7}", 1.0, 1)]
    pool = ExperiencePool()
    pool.add(earlier)
    cfg = config.parse_config(["--self-distill-coef", "1"])
    built = lanpo.build_prompts(tokenizer, [problem], pool, {}, cfg)
    pool.add([Trial("p1", problem["problem"], "scratch", "", "7. \\boxed{7}", 1.0, 2)])
    pool.save(tmp_path / "pool.jsonl")
    pairs = probe.pairs(tmp_path / "pool.jsonl", tokenizer, cfg)
    assert pairs == [(built[0].plain, built[0].teacher, "7. \\boxed{7}")]
    assert "\\boxed{7}" in built[0].teacher and "\\boxed{8}" not in built[0].teacher  # the newest attempt only
