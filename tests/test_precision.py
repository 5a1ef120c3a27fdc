"""bf16 on the CPU: which CPUs count as computing bf16 natively, what --dtype auto resolves to, and the
sampler-mismatch correction (truncated importance weights pi_old / pi_sampler) with its metrics."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import config
import cpu
import grpo
import update

X86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SPR = "processor\t: 0\nflags\t\t: fpu avx512f amx_tile amx_int8 amx_bf16\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"
native_bf16 = cpu.native_bf16  # the real one: conftest's fp32_by_default patches the module's in each test
OLD_X86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\nbugs\t\t: bf16_bug\n"


def test_native_bf16_reads_the_feature_flags():
    assert native_bf16(X86) == "avx512_bf16"
    assert native_bf16(SPR) == "amx_bf16"
    assert native_bf16(GRAVITON3) == "bf16"
    assert native_bf16(OLD_X86) == ""  # a flag name elsewhere in the file is not a feature
    assert native_bf16("") == ""


@pytest.mark.parametrize("requested,on_gpu,native,sharded,expected", [
    ("auto", True, "", False, "bf16-mixed"),
    ("auto", False, "avx512_bf16", False, "bf16-mixed"),
    ("auto", False, "", False, "fp32"),
    ("auto", False, "amx_bf16", True, "fp32"),
    ("fp32", False, "avx512_bf16", False, "fp32"),
    ("bf16-mixed", False, "", False, "bf16-mixed"),  # asked for: emulated bf16 is slow, but it is what was asked
    ("bf16", True, "", True, "bf16"),
])
def test_auto_dtype_is_bf16_mixed_only_where_the_hardware_computes_bf16(requested, on_gpu, native, sharded,
                                                                        expected):
    resolved, why = config.resolve_dtype(requested, on_gpu, native, sharded)
    assert resolved == expected
    assert bool(why) == (requested == "auto" and not on_gpu)  # auto on CPU always says what it chose
    if why:
        assert why.startswith(f"--dtype auto: {expected}") and (native in why if expected != "fp32" else True)


def test_sampler_mismatch_on_hand_computed_ratios():
    """r = 2, 1, 0.5: k3 = (2 - 1 - ln 2) + 0 + (0.5 - 1 + ln 2) over 3 = 1/6; quantiles interpolate linearly."""
    log_r = [torch.tensor([math.log(2.0), 0.0]), torch.tensor([math.log(0.5)])]
    out = update.sampler_mismatch(log_r, cap=1.5)
    assert out["sampler_kl"] == pytest.approx(1 / 6, abs=1e-7)  # float32 log ratios
    assert out["sampler_ratio_p01"] == pytest.approx(0.51)
    assert out["sampler_ratio_p50"] == pytest.approx(1.0)
    assert out["sampler_ratio_p99"] == pytest.approx(1.98)
    assert out["sampler_ratio_max"] == pytest.approx(2.0)
    assert out["sampler_is_capped"] == pytest.approx(1 / 3)
    assert "sampler_is_capped" not in update.sampler_mismatch(log_r, cap=0.0)
    assert update.sampler_mismatch([], 2.0) == update.sampler_mismatch([torch.zeros(0)], 2.0) == {}


def one_token_rows(theta: torch.Tensor, sampler_logits: torch.Tensor, advantages: torch.Tensor):
    """One single-token rollout per vocabulary entry y: (Forward, MicroBatch) of the policy softmax(theta)
    and a sampler softmax(sampler_logits)."""
    logp = torch.log_softmax(theta, dim=-1)
    q = torch.log_softmax(sampler_logits, dim=-1)
    rows = []
    for y in range(len(theta)):
        mask = torch.ones(1, 1)
        f = update.Forward(None, logp[y].view(1, 1), torch.zeros(1, 1), mask, logp[y].detach().view(1, 1))
        mb = update.MicroBatch(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), torch.ones(1, 1),
                               advantages[y].view(1), mask, sampler_logps=q[y].view(1, 1),
                               sampler_rows=torch.tensor([True]))
        rows.append((f, mb))
    return rows


def expected_gradient(theta, sampler_logits, advantages, cfg) -> torch.Tensor:
    """E over tokens drawn from the sampler of the gradient of the policy-gradient term, exactly (a sum over
    the vocabulary weighted by the sampler's probabilities)."""
    q = torch.softmax(sampler_logits, dim=-1)
    total = torch.zeros_like(theta)
    for y, (f, mb) in enumerate(one_token_rows(theta, sampler_logits, advantages)):
        loss = update.policy_gradient_loss(f, mb, cfg, {"seqs": 1, "tokens": 1}, {})
        total += q[y] * torch.autograd.grad(loss, theta, retain_graph=True)[0]
    return total


def test_truncated_weights_correct_a_perturbed_sampler():
    """Tokens drawn from a perturbed sampler q, trained as if drawn from the policy p: the expected gradient
    is E_q[A grad log p], biased. With the weights min(p/q, C) and a cap above every ratio it is E_p[A grad log
    p], the on-policy gradient, exactly; the same dtype on both sides (fp32) applies no weight."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(6, generator=g).requires_grad_()
    sampler_logits = theta.detach() + 0.5 * torch.randn(6, generator=g)
    advantages = torch.randn(6, generator=g)
    cfg = dataclasses.replace(config.Config(), dtype="bf16-mixed", sampler_is_cap=100.0)
    on_policy = expected_gradient(theta, theta.detach(), advantages, cfg)
    corrected = expected_gradient(theta, sampler_logits, advantages, cfg)
    uncorrected = expected_gradient(theta, sampler_logits, advantages, dataclasses.replace(cfg, sampler_is_cap=0.0))
    same_dtype = expected_gradient(theta, sampler_logits, advantages, dataclasses.replace(cfg, dtype="fp32"))
    torch.testing.assert_close(corrected, on_policy, atol=1e-6, rtol=1e-5)
    assert (uncorrected - on_policy).norm() > 0.1 * on_policy.norm()  # measured: 17 %
    torch.testing.assert_close(same_dtype, uncorrected, atol=0, rtol=0)


def test_weights_are_truncated_at_the_cap_and_exactly_one_without_correction():
    theta = torch.tensor([0.0, 0.0]).requires_grad_()
    sampler_logits = torch.tensor([math.log(9.0), 0.0])  # q = 0.9, 0.1 against p = 0.5, 0.5: ratios 5/9 and 5
    rows = one_token_rows(theta, sampler_logits, torch.ones(2))
    cfg = dataclasses.replace(config.Config(), dtype="bf16-mixed", sampler_is_cap=2.0)
    weights = [update.sampler_weights(f, mb, cfg).item() for f, mb in rows]
    assert weights == pytest.approx([5 / 9, 2.0])
    for dtype in ("fp32", "bf16", "fp16"):
        assert all(update.sampler_weights(f, mb, dataclasses.replace(cfg, dtype=dtype)) is None for f, mb in rows)
    # rows trained on another prompt than they were sampled with take no sampler weight (and no ratio)
    f, mb = rows[1]
    mb = dataclasses.replace(mb, sampler_rows=torch.tensor([False]), sampler_log_ratio=None)
    assert update.sampler_weights(f, mb, cfg).item() == 1.0 and mb.sampler_log_ratio.numel() == 0
    # the loss with weight None is the plain GRPO loss, bit for bit
    f, mb = rows[0]
    plain, _ = grpo.policy_loss(f.logps, f.old, mb.advantages, f.mask)
    fp32 = update.policy_gradient_loss(f, mb, dataclasses.replace(cfg, dtype="fp32"), {"seqs": 1, "tokens": 1}, {})
    assert torch.equal(plain, fp32)
