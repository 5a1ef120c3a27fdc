"""lanpo.py end to end on a tiny random model: generate -> grade -> update, for real, several configs."""

import contextlib
import ctypes
import dataclasses
import json
import math
import os
import platform
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

import config
import cpu
import grpo
import lanpo
import rollout
import rundir
import update


def documented_metric_keys() -> set[str]:
    return set(re.findall(r"^\| `([a-z_0-9/]+)` \|", (ROOT / "docs" / "metrics.md").read_text(), flags=re.M))


def run(tiny_model_dir, tmp_path, *extra):
    cfg = config.parse_config(["--model", str(tiny_model_dir), "--out-dir", str(tmp_path / "run"),
                               "--steps", "2", "--batch-problems", "2", "--group-size", "4", "--micro-batch", "4",
                               "--max-new-tokens", "8", "--eval-size", "4", "--eval-every", "1",
                               "--report-to", "none", "--lr", "1e-2", *extra])
    lanpo.main(cfg)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return cfg, [json.loads(line) for line in lines]


def _params(model_dir):
    from transformers import AutoModelForCausalLM

    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()}


def test_two_full_steps_update_the_model_and_log_every_documented_key(tiny_model_dir, tmp_path, graded_by_parity):
    cfg, records = run(tiny_model_dir, tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    documented = documented_metric_keys()
    assert len(documented) > 20
    for r in records:
        assert documented >= set(r) - {"step"}, set(r) - documented
        assert all(torch.isfinite(torch.tensor(float(v))) for v in r.values())
    # only the kinds present
    per_kind = {k for k in documented if k.endswith(("/reward", "/accuracy", "/len", "/truncated"))}
    optional = {k for k in documented if k.startswith(("eval_", "time_eval", "distill_", "self_distill_",  # options
                                                         "feedback_model_", "reward_failures", "compile",  # off
                                                         "relevance_score_p", "relevance_family",  # measured
                                                         "relevance_precision", "relevance_recall",  # only
                                                         "sampler_is_capped"))}  # bf16-mixed
    per_step = documented - per_kind - optional
    assert per_step <= set(records[0]), per_step - set(records[0])
    assert "eval_accuracy" in records[1]
    before, after = _params(tiny_model_dir), _params(tmp_path / "run" / "final")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)  # every weight took a gradient step
    assert (tmp_path / "run" / "checkpoints" / "step-000002" / "lanpo_state.json").exists()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["group_size"] == 4


def test_kl_and_several_epochs(tiny_model_dir, tmp_path, graded_by_parity):
    """The reference is the initial model: at step 1's only epoch the policy is that model (KL exactly 0,
    ratio 1); after one update it has moved away (KL > 0). With two epochs the second sees a moved policy."""
    _, one = run(tiny_model_dir, tmp_path / "one", "--beta", "0.1", "--loss-type", "dapo")
    assert one[0]["kl"] == 0.0 and one[0]["ratio_mean"] == 1.0 and one[1]["kl"] > 1e-6
    _, two = run(tiny_model_dir, tmp_path / "two", "--beta", "0.1", "--ppo-epochs", "2", "--loss-type", "dapo")
    assert two[0]["kl"] > 1e-6 and two[0]["ratio_mean"] != pytest.approx(1.0, abs=1e-6)


def test_lora_uses_the_adapter_free_model_as_reference(tiny_model_dir, tmp_path, graded_by_parity):
    _, records = run(tiny_model_dir, tmp_path, "--lora-rank", "4", "--beta", "0.1")
    # the adapter starts at zero, so the policy is its base at step 1; then the adapter has moved it
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-9) and records[1]["kl"] > 1e-6
    assert (tmp_path / "run" / "final" / "adapter_config.json").exists()
    import evaluate  # a LoRA checkpoint evaluates as its base with the adapter merged

    bench = tmp_path / "b.jsonl"
    bench.write_text('{"id": "x", "problem": "What is 1 + 1?", "answer": "2"}\n')
    results = evaluate.main(["--model", str(tmp_path / "run" / "final"), "--benchmarks", str(bench),
                             "--max-new-tokens", "4", "--out-dir", str(tmp_path / "eval")])
    assert results["b.jsonl"]["zero-shot"]["problems"] == 1



def _lora_with_moved_adapters(tiny_model_dir):
    """The tiny model with rank-4 LoRA on every linear layer, its adapters moved off peft's zero start."""
    import models

    model = models.load_policy(str(tiny_model_dir), torch.float32, lora_rank=4).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, q in model.named_parameters():
            if "lora_B" in name:
                q.normal_(0, 0.5)
    return model


def test_merged_lora_gives_the_adapters_outputs_and_restores_the_exact_base(tiny_model_dir):
    """Inside models.merged_lora: the adapters' logits (to float rounding) from merged weights, and not the
    base model's (the adapters matter here); after it: the very same base tensors, bit for bit, and the
    adapters back in the forward."""
    import models

    model = _lora_with_moved_adapters(tiny_model_dir)
    ids = torch.randint(3, 300, (3, 20))
    before = {name: (q.data_ptr(), q.detach().clone()) for name, q in model.named_parameters()}
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        with models.merged_lora(model) as merged_layers:
            merged = model(input_ids=ids).logits
            assert all(q.data_ptr() != before[n][0] for n, q in model.named_parameters() if "base_layer.weight" in n)
        after = model(input_ids=ids).logits
    assert merged_layers == 2 * 7  # q k v o gate up down in each of the 2 layers
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(merged, base, atol=1e-2)
    assert torch.equal(after, adapted)
    for name, q in model.named_parameters():
        assert q.data_ptr() == before[name][0] and torch.equal(q, before[name][1]), name


def test_merged_lora_samples_the_same_completions(tiny_model_dir, tiny):
    """Fixed seed: the same sampled and greedy completions from merged weights as through the adapters, eager
    and with the decoding step compiled (--compile-decoding), either way."""
    import models
    from rollout import generate_completions

    model, tokenizer = _lora_with_moved_adapters(tiny_model_dir), tiny[1]
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in ("What is 2 + 5?", "Is 7 odd?")] * 3
    for greedy in (False, True):
        outs = []
        for merge, compiled in ((False, False), (True, False), (False, True), (True, True)):
            torch.manual_seed(0)
            with models.merged_lora(model) if merge else contextlib.nullcontext():
                outs.append([c.completion_ids.tolist() for c in generate_completions(
                    model, tokenizer, texts, eos_ids=eos, max_new_tokens=12, greedy=greedy, compiled=compiled)])
        assert outs[1] == outs[0] and outs[2] == outs[0] and outs[3] == outs[0], greedy

def test_bad_flags_fail_before_compute(tiny_model_dir, tmp_path):
    with pytest.raises(SystemExit, match="does not divide"):
        config.parse_config(["--batch-problems", "3", "--group-size", "4", "--micro-batch", "8"])
    with pytest.raises(SystemExit, match="not a known alias"):
        lanpo.main(config.parse_config(["--model", "no-such-model", "--out-dir", str(tmp_path)]))
    with pytest.raises(SystemExit, match="no column"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"question": "1+1", "answer": "2"}\n')
        lanpo.main(config.parse_config(["--model", str(tiny_model_dir), "--dataset", str(bad),
                                        "--out-dir", str(tmp_path)]))


def test_problems_for_step_is_a_seeded_permutation():
    rows = [{"id": str(i)} for i in range(10)]
    ids = [r["id"] for s in range(5) for r in lanpo.problems_for_step(rows, s, 4, seed=1)]
    assert sorted(ids[:10]) == [str(i) for i in range(10)]  # first epoch covers every problem once
    assert ids == [r["id"] for s in range(5) for r in lanpo.problems_for_step(rows, s, 4, seed=1)]
    assert ids != [r["id"] for s in range(5) for r in lanpo.problems_for_step(rows, s, 4, seed=2)]


def test_resume_drops_rerun_and_torn_metric_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a": 3}\n{"step": 4, "a"')
    rundir.truncate_metrics(path, 2)
    assert path.read_text() == '{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n'


def test_overlong_prompts_stop_the_run_or_are_skipped(tiny_model_dir, tmp_path, graded_by_parity, capsys):
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"What is {i} + 1? " * (1 if i else 200),
                                        "answer": "2"}) + "\n" for i in range(4)))
    common = ["--model", str(tiny_model_dir), "--dataset", str(path), "--max-prompt-tokens", "300", "--steps", "1",
              "--batch-problems", "2", "--group-size", "2", "--micro-batch", "4", "--max-new-tokens", "4",
              "--report-to", "none", "--eval-every", "0"]
    with pytest.raises(SystemExit, match=r"problem 'p0' makes a \d+-token prompt, over --max-prompt-tokens 300"):
        lanpo.main(config.parse_config(common + ["--out-dir", str(tmp_path / "a")]))
    lanpo.main(config.parse_config(common + ["--out-dir", str(tmp_path / "b"), "--skip-bad-rows"]))
    out = capsys.readouterr().out
    assert "skipped 1 rows" in out and "'prompt_too_long': 1" in out


def test_bf16_mixed_precision_trains(tiny_model_dir, tmp_path, graded_by_parity, monkeypatch):
    """bf16-mixed: the update under bf16 autocast with fp32 master weights (a gradient that differs from fp32's
    by bf16 rounding), sampling under bf16 autocast too, from the fp32 masters (no copy to refresh), its
    mismatch to the update logged and corrected (TIS). fp32 samples without autocast: a mismatch of float
    rounding, no correction."""
    from accelerate.state import AcceleratorState

    sampled = []
    real = lanpo.generate_completions

    def recorded(model, *args, **kwargs):
        sampled.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                        {p.dtype for p in model.parameters()}))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(lanpo, "generate_completions", recorded)
    _, records = run(tiny_model_dir, tmp_path, "--dtype", "bf16-mixed", "--eval-every", "0")
    AcceleratorState._reset_state(reset_partial_state=True)  # the next run's mixed precision differs
    assert json.loads((tmp_path / "run" / "config.json").read_text())["dtype"] == "bf16-mixed"
    assert sampled == [(True, torch.bfloat16, {torch.float32})] * 2
    before, after = _params(tiny_model_dir), _params(tmp_path / "run" / "final")
    assert all(v.dtype == torch.float32 for v in after.values())  # master weights stay fp32
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for r in records:
        assert 0 < r["sampler_kl"] < 1e-2 and r["sampler_ratio_p01"] <= 1 <= r["sampler_ratio_p99"]
        assert r["sampler_is_capped"] == 0.0
    sampled.clear()
    _, fp32 = run(tiny_model_dir, tmp_path / "fp32", "--dtype", "fp32", "--eval-every", "0")
    assert [autocast for autocast, _, _ in sampled] == [False, False]
    assert records[0]["grad_norm"] == pytest.approx(fp32[0]["grad_norm"], rel=5e-2)
    assert records[0]["grad_norm"] != pytest.approx(fp32[0]["grad_norm"], rel=1e-6)  # autocast did run
    for r in fp32:
        assert r["sampler_kl"] < 1e-9 and "sampler_is_capped" not in r


def test_a_finished_run_is_never_overwritten(tiny_model_dir, tmp_path, graded_by_parity):
    run(tiny_model_dir, tmp_path)
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit, match="already holds a run .* pass --resume"):
        run(tiny_model_dir, tmp_path)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


def test_no_final_checkpoint_keeps_only_the_weights(tiny_model_dir, tmp_path, graded_by_parity):
    run(tiny_model_dir, tmp_path, "--no-final-checkpoint", "--eval-every", "0")
    assert (tmp_path / "run" / "final" / "config.json").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()
    run(tiny_model_dir, tmp_path / "with", "--eval-every", "0")  # the default keeps a resumable last step
    assert [p.name for p in (tmp_path / "with" / "run" / "checkpoints").iterdir()] == ["step-000002"]
    # the README's figure: the optimizer state is 8 bytes per trained parameter (AdamW's two fp32 moments)
    trained = sum(v.numel() for v in _params(tmp_path / "with" / "run" / "final").values())
    state = (tmp_path / "with" / "run" / "checkpoints" / "step-000002" / "optimizer.bin").stat().st_size
    assert 8 * trained <= state <= 8 * trained + 64 * 1024, (state, trained)
    assert "8 bytes per trained parameter beside the weights" in (ROOT / "README.md").read_text()


FREE_AND_REALLOCATE = r"""
import resource, sys
import torch
sys.path.insert(0, sys.argv[1])
import cpu
import lanpo  # noqa: F401 - the process as a run has it: everything lanpo.py imports loaded
assert cpu.speed_up(host_memory=sys.argv[2]), "glibc's mallopt refused a setting"
def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
def step():  # ten 8 MB blocks, written, then all freed: what an update does to its activations
    blocks = [torch.ones(2**21) for _ in range(10)]
    del blocks
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
if sys.argv[2] == "trim":  # the end of a phase
    assert cpu.trim_freed_host_memory(), "glibc's malloc_trim is missing"
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, resident_mb())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc and Linux fault counts")
def test_cpu_host_memory_keep_reuses_freed_memory_and_return_gives_it_back():
    """Five rounds allocate 400 MB (102,400 pages). Under --cpu-host-memory keep (keep_freed_host_memory) the
    process faults under a tenth of them back in and keeps the 80 MB a round frees resident; under return
    (return_freed_host_memory) it faults nearly every page in again and its resident size falls back to
    where it was before the round (without either setting, 22,000-102,000 faults, measured); under trim the
    rounds (one phase) fault as under keep, and the trim at the phase's end gives the 80 MB back."""
    faults, resident = {}, {}
    for mode in ("keep", "return", "trim"):
        done = subprocess.run([sys.executable, "-c", FREE_AND_REALLOCATE, str(ROOT), mode], capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr
        faults[mode], resident[mode] = int(done.stdout.split()[-2]), float(done.stdout.split()[-1])
    assert faults["keep"] < 10_240 and faults["return"] > 90_000 and faults["trim"] < 10_240
    assert resident["keep"] - resident["return"] > 60  # the freed 80 MB: kept, or given back
    assert resident["keep"] - resident["trim"] > 60


def test_the_mutation_bench_leaves_the_malloc_test_out_by_name_and_stops_when_the_name_is_gone(tmp_path):
    """bench/mutation.py's pytest plugin deselects the test above (mutmut's instrumentation inflates its page
    faults) by its node id: with a file that has the name, only the other test runs; with a file that lost it
    (a rename), the run stops naming it, rather than running the test again unnoticed."""
    sys.path.insert(0, str(ROOT / "bench"))
    import mutation

    (tmp_path / "mutation_unit_only.py").write_text(mutation.UNIT_ONLY % mutation.LEFT_OUT)
    (tmp_path / "tests").mkdir()
    name = mutation.LEFT_OUT[0].split("::")[1]
    pytest_run = [sys.executable, "-m", "pytest", "-q", "-p", "mutation_unit_only", "tests/test_train.py"]
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    (tmp_path / "tests/test_train.py").write_text(f"def {name}():\n    assert False\n\ndef test_other():\n    pass\n")
    done = subprocess.run(pytest_run, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "1 passed, 1 deselected" in done.stdout, done.stdout + done.stderr
    (tmp_path / "tests/test_train.py").write_text("def test_other():\n    pass\n")
    done = subprocess.run(pytest_run, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode != 0 and "which the tests no longer have" in done.stdout + done.stderr
    assert name in done.stdout + done.stderr


def test_cpu_host_memory_trim_hands_memory_back_after_sampling_and_after_the_update(tiny_model_dir, tmp_path,
                                                                                   graded_by_parity, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu, "trim_freed_host_memory", lambda: calls.append(1) or True)
    run(tiny_model_dir, tmp_path / "keep", "--steps", "1", "--eval-every", "0")
    assert calls == []
    run(tiny_model_dir, tmp_path / "trim", "--steps", "2", "--eval-every", "0", "--cpu-host-memory", "trim")
    assert len(calls) == 4


def test_without_glibc_the_run_says_freed_memory_is_not_kept(tiny_model_dir, tmp_path, graded_by_parity, monkeypatch,
                                                            capsys):
    def no_libc(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert cpu.keep_freed_host_memory() is False
    run(tiny_model_dir, tmp_path, "--steps", "1", "--eval-every", "0")
    assert "malloc is not glibc's" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--cpu-rows-first-matmul", "--no-cpu-rows-first-matmul"])
def test_cpu_runs_decode_with_rows_first_linears_unless_told_not_to(tiny_model_dir, tmp_path, graded_by_parity,
                                                                    monkeypatch, flag):
    seen = []
    real = cpu.rows_first_linears
    monkeypatch.setattr(cpu, "rows_first_linears", lambda model: seen.append(real(model)) or seen[-1])
    run(tiny_model_dir, tmp_path, "--steps", "1", "--eval-every", "0", flag)
    assert seen == ([2 * 7 + 1] if flag == "--cpu-rows-first-matmul" else [])


def _update_gradient(model, tokenizer, rows: list[tuple[str, str, bool]], advantages: list[float], *flags):
    """The summed gradient of the update's loss terms over rollouts (prompt, completion, truncated) of one
    group, built the way the loop builds them (update_batch -> micro_batches -> forward -> loss terms)."""
    import prompts
    from rollout import Completion

    rows = [(prompts.render_prompt(tokenizer, prompts.problem_request(p), one_shot=False), c, t) for p, c, t in rows]
    cfg = config.parse_config(["--batch-problems", "1", "--group-size", str(len(rows)), "--micro-batch",
                               str(len(rows)), "--feedback", "none", *flags])
    completions = [Completion(rollout.token_ids(tokenizer, p), rollout.token_ids(tokenizer, c), t, c)
                   for p, c, t in rows]
    prompts = [lanpo.Prompt(p, p, "scratch", "") for p, _, _ in rows]
    r = lanpo.Rollouts([{"id": "x", "problem": "x", "answer": "1"}] * len(rows), prompts, completions,
                       torch.zeros(len(rows)), torch.tensor(advantages))
    b = lanpo.update_batch(tokenizer, r, r.problems[:1], {}, cfg, [tokenizer.eos_token_id], world=1)
    model.zero_grad()
    for mb in update.micro_batches(model, None, b, cfg, tokenizer.pad_token_id, "cpu"):
        update.policy_gradient_loss(update.forward(model, mb, cfg), mb, cfg, b.window, {}).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_mask_truncated_changes_only_the_truncated_rows(tiny, loss_type):
    """--mask-truncated: the gradient equals that of the same update without the truncated rows (as if they
    had never been sampled: the finished rows' terms and normalisers as they would be alone), and differs from
    the unmasked one; advantages (graded with the truncated rows in the group) are left as they were."""
    model, tokenizer = tiny
    done, cut = ("What is 2 + 5?", " 7 = 7<|im_end|>", False), ("What is 2 + 5?", " 2 + 5 + 5 + 5 +", True)
    other = ("Tom has 12 apples.", " 12 apples<|im_end|>", False)
    rows, adv = [done, cut, other, cut], [1.0, -0.5, 0.5, -1.0]
    kind = ["--loss-type", loss_type]
    masked = _update_gradient(model, tokenizer, rows, adv, "--mask-truncated", *kind)
    finished_only = _update_gradient(model, tokenizer, [done, other], [1.0, 0.5], *kind)
    unmasked = _update_gradient(model, tokenizer, rows, adv, *kind)
    assert torch.allclose(masked, finished_only, rtol=1e-5, atol=1e-8)
    assert not torch.allclose(masked, unmasked, rtol=1e-3)
    assert torch.equal(_update_gradient(model, tokenizer, [done, other], [1.0, 0.5], "--mask-truncated", *kind),
                       finished_only)  # nothing truncated: the flag changes nothing


def _logps(model, tokenizer, prompt: str, completion: str) -> torch.Tensor:
    """log pi(completion token | prompt, earlier tokens), one forward written out by hand."""
    ids = rollout.token_ids(tokenizer, prompt + completion)
    n = len(rollout.token_ids(tokenizer, completion))
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, -n - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[-n:, None]).squeeze(-1)


@pytest.mark.parametrize(("grad", "cap"), [("strip", 1.0), ("distill", 1.0), ("distill", 0.5), ("distill", 0.0)])
def test_feedback_rollouts_trained_on_the_plain_prompt_weigh_each_token_as_stated(tiny, grad, cap):
    """--feedback-grad strip: a reflection rollout's ratio is pi(y_t | plain) / pi(y_t | reflection prompt) at
    every token (the scratch rollout's is 1); distill: its weight is that ratio truncated at --distill-is-cap
    (0: no correction). Both against log-probs computed by hand from the two prompts."""
    import prompts

    model, tokenizer = tiny
    plain = prompts.render_prompt(tokenizer, prompts.problem_request("What is 2 + 5?"), one_shot=False)
    shown = prompts.render_prompt(tokenizer, prompts.reflection_request("What is 2 + 5?", ["2 + 5 = 8"]), False)
    completions = [" 2 + 5 = 7<|im_end|>", " 7 = 2 + 5 = 7<|im_end|>"]
    from rollout import Completion

    cfg = config.parse_config(["--batch-problems", "1", "--group-size", "2", "--micro-batch", "2", "--feedback",
                               "reflect", "--feedback-grad", grad, "--distill-is-cap", str(cap)])
    r = lanpo.Rollouts([{"id": "x", "problem": "What is 2 + 5?", "answer": "7"}] * 2,
                       [lanpo.Prompt(plain, plain, "scratch", ""), lanpo.Prompt(shown, plain, "reflect", "2 + 5 = 8")],
                       [Completion(rollout.token_ids(tokenizer, p), rollout.token_ids(tokenizer, c), False, c)
                        for p, c in zip((plain, shown), completions)], torch.zeros(2), torch.tensor([1.0, -1.0]))
    b = lanpo.update_batch(tokenizer, r, r.problems[:1], {}, cfg, [tokenizer.eos_token_id], world=1)
    (mb,) = update.micro_batches(model, None, b, cfg, tokenizer.pad_token_id, "cpu")
    stats = {}
    update.policy_gradient_loss(update.forward(model, mb, cfg), mb, cfg, b.window, stats)
    by_hand = (_logps(model, tokenizer, plain, completions[1]) - _logps(model, tokenizer, shown, completions[1])).exp()
    n_scratch = len(rollout.token_ids(tokenizer, completions[0]))
    if grad == "strip":  # the ratio of the scratch rollout's tokens is 1
        want = (n_scratch + by_hand.sum()) / (n_scratch + len(by_hand))
        assert stats["ratio_mean"][0][0] == pytest.approx(want.item(), rel=1e-4)
        assert abs(want.item() - 1) > 1e-3  # the two prompts do give the tokens other probabilities
    else:
        weights = torch.ones_like(by_hand) if cap == 0 else by_hand.clamp(max=cap)
        assert stats["distill_is_weight"][0][0] == pytest.approx(weights.mean().item(), rel=1e-4)
        assert stats["ratio_mean"][0][0] == pytest.approx(1.0)  # on-policy: pi_old is the plain-prompt policy


def test_a_step_with_every_completion_masked_is_skipped_not_poisoned(tiny_model_dir, tmp_path, graded_by_parity):
    """The tiny model never stops within 8 tokens, so --mask-truncated leaves nothing in the loss: no update is
    made (the weights stay the initial ones), nothing is counted as a bad update (0/0 would have been NaN), and
    no update statistic is logged, as none was measured."""
    _, records = run(tiny_model_dir, tmp_path, "--mask-truncated", "--eval-every", "0")
    assert all(r["truncated_frac"] == 1.0 and r["skipped_updates"] == 0 and r["time_update"] == 0.0 for r in records)
    assert not any(key in r for r in records for key in ("loss", "entropy", "ratio_mean", "grad_norm"))
    before, after = _params(tiny_model_dir), _params(tmp_path / "run" / "final")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_loss_term_added_as_the_readme_says_trains_and_logs(tiny_model_dir, tmp_path, graded_by_parity,
                                                               monkeypatch):
    """The README's recipe, followed literally with an entropy bonus: an `entropy_coef` field on Config and a
    function of (f, mb, cfg, window, stats) in update.LOSS_TERMS under that field, its loss recorded with
    add_loss. Switched on, through f.entropy_with_grad() it changes the trained weights and its summed value is
    logged; the same term on f.entropy (a statistic without a graph) would log a value and change nothing, which
    is why the contract names the difference. Off (0), it is never called and logs nothing; set with no entry in
    LOSS_TERMS, the run stops in one line before any model loads."""
    @dataclasses.dataclass
    class WithEntropy(config.Config):
        entropy_coef: float = config._f(0.0, "weight of an entropy bonus")

    monkeypatch.setattr(config, "Config", WithEntropy)
    calls = []

    def entropy_bonus(f, mb, cfg, window, stats):
        calls.append(cfg.entropy_coef)
        loss = -cfg.entropy_coef * f.entropy_with_grad().sum() / window["tokens"]
        update.add_loss(stats, "entropy_bonus_loss", loss.item())
        return loss

    def entropy_bonus_without_graph(f, mb, cfg, window, stats):
        return -cfg.entropy_coef * f.entropy.sum() / window["tokens"]

    weights = {}
    for name, term, coef in [("plain", None, "0"), ("off", entropy_bonus, "0"), ("bonus", entropy_bonus, "10"),
                             ("no-graph", entropy_bonus_without_graph, "10")]:
        extra = [] if term is None else [(term, "entropy_coef")]
        monkeypatch.setattr(update, "LOSS_TERMS", [(update.policy_gradient_loss, None),
                                                   (update.self_distill_loss, "self_distill_coef"), *extra])
        _, records = run(tiny_model_dir, tmp_path / name, "--steps", "1", "--eval-every", "0", "--entropy-coef", coef)
        weights[name] = _params(tmp_path / name / "run" / "final")
        assert ("entropy_bonus_loss" in records[0]) == (name == "bonus")
        if name == "off":
            assert calls == []  # off: never called, so it costs nothing
    assert calls and set(calls) == {10.0}
    first = json.loads((tmp_path / "bonus" / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["entropy_bonus_loss"] == pytest.approx(-10.0 * first["entropy"], rel=1e-3)  # one micro-batch
    assert all(torch.equal(weights["plain"][k], weights["off"][k]) for k in weights["plain"])
    assert any(not torch.equal(weights["plain"][k], weights["bonus"][k]) for k in weights["plain"])
    assert all(torch.equal(weights["plain"][k], weights["no-graph"][k]) for k in weights["plain"])
    monkeypatch.setattr(update, "LOSS_TERMS", [(update.policy_gradient_loss, None)])
    with pytest.raises(SystemExit, match=r"^--entropy-coef is set, but no loss term in update.LOSS_TERMS reads it"):
        run(tiny_model_dir, tmp_path / "unread", "--entropy-coef", "10")
    assert not (tmp_path / "unread" / "run").exists()


def test_resuming_a_finished_run_says_how_to_extend_it(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    flags = ["--model", str(tiny_model_dir), "--out-dir", str(run), "--steps", "1", "--batch-problems", "2",
             "--group-size", "2", "--micro-batch", "4", "--max-new-tokens", "3", "--eval-every", "0",
             "--report-to", "none"]
    lanpo.main(config.parse_config(flags))
    capsys.readouterr()
    lanpo.main(config.parse_config(["--resume", str(run)]))
    out = capsys.readouterr().out
    assert f"all 1 steps are done; --resume {run} --steps N with N > 1 extends the run" in out


def test_policy_gradient_loss_passes_every_setting_and_weight_to_the_surrogate():
    """update.policy_gradient_loss against grpo.policy_loss called by hand with the same settings (clip bounds,
    beta and the reference, loss type and completion length, the batch's normalisers) and the distill weights
    of the off-policy rows: the same loss to the bit; its statistics weighted by the micro-batch's tokens, the
    entropy averaged over the loss tokens, the distill weight over the off-policy tokens."""
    g = torch.Generator().manual_seed(3)
    rows, width = 4, 5
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float32)
    logps = (-torch.rand(rows, width, generator=g) * mask).requires_grad_()
    old = (logps.detach() + 0.3 * torch.randn(rows, width, generator=g)) * mask
    ref = (logps.detach() + 0.2 * torch.randn(rows, width, generator=g)) * mask
    sampling = (logps.detach() - 0.5 * torch.rand(rows, width, generator=g)) * mask
    entropy = torch.rand(rows, width, generator=g) * mask
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    off = torch.tensor([False, True, False, True])
    f = update.Forward(None, logps, entropy, mask, old)
    mb = update.MicroBatch(torch.zeros(rows, 8, dtype=torch.long), torch.ones(rows, 8), mask, advantages, mask,
                           sampling_logps=sampling, off_policy=off, ref_logps=ref)
    cfg = config.Config(feedback_grad="distill", distill_is_cap=1.5, eps_low=0.1, eps_high=0.28, beta=0.04,
                        loss_type="dr_grpo", max_new_tokens=width)
    window = {"seqs": 10, "tokens": 37}
    weights = torch.where(off[:, None], torch.exp(old - sampling).clamp(max=1.5), 1.0)
    for loss_type in ("grpo", "dapo", "dr_grpo"):  # dapo divides by the window's tokens, dr_grpo by its rows
        stats = {}
        loss = update.policy_gradient_loss(f, mb, dataclasses.replace(cfg, loss_type=loss_type), window, stats)
        expected, s = grpo.policy_loss(logps, old, advantages, mask, ref, eps_low=0.1, eps_high=0.28, beta=0.04,
                                       loss_type=loss_type, max_completion_len=width, window_seqs=10,
                                       window_tokens=37, token_weights=weights)
        assert torch.equal(loss, expected) and stats["loss"] == [(expected.item(), None)], loss_type
    tokens = s.pop("tokens")
    assert tokens == mask.sum().item() and {k: stats[k] for k in s} == {k: [(v, tokens)] for k, v in s.items()}
    assert stats["entropy"] == [(pytest.approx((entropy.sum() / mask.sum()).item()), tokens)]
    off_tokens = mask * off[:, None]
    assert stats["distill_is_weight"] == [(pytest.approx(((weights * off_tokens).sum() / off_tokens.sum()).item()),
                                           off_tokens.sum().item())]
    # the distill weights only under --feedback-grad distill, and only where the batch has off-policy rows
    for grad, sampling_logps in (("context", sampling), ("distill", None)):
        stats = {}
        mb_ = dataclasses.replace(mb, sampling_logps=sampling_logps)
        loss = update.policy_gradient_loss(f, mb_, dataclasses.replace(cfg, feedback_grad=grad), window, stats)
        plain, _ = grpo.policy_loss(logps, old, advantages, mask, ref, eps_low=0.1, eps_high=0.28, beta=0.04,
                                    loss_type="dr_grpo", max_completion_len=width, window_seqs=10, window_tokens=37)
        assert torch.equal(loss, plain) and "distill_is_weight" not in stats
    stats = {}
    update.policy_gradient_loss(f, dataclasses.replace(mb, off_policy=torch.zeros(rows, dtype=torch.bool)), cfg,
                                window, stats)
    assert "distill_is_weight" not in stats  # no off-policy token: nothing to average
    one = torch.zeros(rows, width)
    one[0, 0] = 1.0  # a micro-batch with a single loss token: its entropy is that token's
    stats = {}
    update.policy_gradient_loss(update.Forward(None, logps * one, entropy * one, one, old * one),
                                dataclasses.replace(mb, cmask=one, loss_mask=one, off_policy=off & False), cfg,
                                window, stats)
    assert stats["entropy"] == [(pytest.approx(entropy[0, 0].item()), 1.0)]


def test_micro_batches_hold_the_fixed_log_probs_each_setting_asks_for(tiny):
    """update.micro_batches on rows with a behaviour prompt, a teacher, sampler log-probs and a row left out of
    the loss: rows sorted by prompt, packed, with their advantages and loss mask; pi_old (--ppo-epochs 2), the
    reference (--beta) and the sampling prompt's log-probs at the sampling temperature, each against a forward
    of its own model on its own prompts; the sampler's log-probs only on rows sampled on their training prompt;
    the teacher's prompts. --feedback-grad strip takes pi_old from the sampling prompts; one epoch and no beta
    compute neither."""
    import copy

    import forwards
    import prompts
    from rollout import Completion, pack

    model, tokenizer = tiny
    ref_model = copy.deepcopy(model)
    with torch.no_grad():
        for w in ref_model.parameters():
            w.add_(0.05 * torch.randn_like(w))
    render = lambda text: rollout.token_ids(tokenizer, prompts.render_prompt(tokenizer, text, one_shot=False))  # noqa: E731
    plain_a, plain_b = render("What is 2 + 5?"), render("Tom has 12 apples and eats 3. How many are left?")
    shown, teacher = render("Earlier: 2 + 5 = 8. What is 2 + 5?"), render("Principle: add. What is 2 + 5?")
    done = [rollout.token_ids(tokenizer, c) for c in (" 7<|im_end|>", " 9 apples<|im_end|>", " 2 + 5 = 7<|im_end|>")]
    rows = [Completion(plain_a, done[0], False, "", sampler_logps=-torch.rand(len(done[0]))),
            Completion(plain_b, done[1], False, "", sampler_logps=-torch.rand(len(done[1]))),
            Completion(plain_a, done[2], False, "", sampler_logps=-torch.rand(len(done[2])))]
    behaviour = [None, None, Completion(shown, done[2], False, "")]
    teachers = [Completion(teacher, done[0], False, ""), None, None]
    b = update.UpdateBatch(rows, torch.tensor([1.0, -0.5, 0.25]), behaviour, teachers, [],
                           {"seqs": 3, "tokens": 9, "feedback_tokens": 0}, torch.tensor([1.0, 0.0, 1.0]))
    cfg = config.parse_config(["--micro-batch", "2", "--ppo-epochs", "2", "--beta", "0.1", "--temperature", "0.7",
                               "--batch-problems", "1", "--group-size", "2"])
    assert len(plain_a) < len(plain_b) and len(done[0]) < len(done[2])
    order = [0, 2, 1]  # by prompt (the shorter first, its rows together), then the shorter completion
    mbs = update.micro_batches(model, ref_model, b, cfg, tokenizer.pad_token_id, "cpu")
    assert [len(mb.ids) for mb in mbs] == [2, 1]
    logps = lambda m, packed: forwards.token_logprobs(m, *packed, 8, 0.7)[0]  # noqa: E731
    for mb, idx in zip(mbs, (order[:2], order[2:]), strict=True):
        packed = pack([rows[i] for i in idx], tokenizer.pad_token_id, "cpu")
        assert all(torch.equal(x, y) for x, y in zip((mb.ids, mb.attn, mb.cmask), packed, strict=True))
        assert torch.equal(mb.advantages, b.advantages[idx])
        assert torch.equal(mb.loss_mask, mb.cmask * b.in_loss[idx][:, None])
        torch.testing.assert_close(mb.old_logps, logps(model, packed), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mb.ref_logps, logps(ref_model, packed), atol=1e-5, rtol=1e-5)
        assert (mb.ref_logps - mb.old_logps).abs().max() > 1e-3  # the two models differ: the check can fail
        sampled = pack([behaviour[i] or rows[i] for i in idx], tokenizer.pad_token_id, "cpu")
        torch.testing.assert_close(mb.sampling_logps, logps(model, sampled), atol=1e-5, rtol=1e-5)
        assert mb.off_policy.tolist() == [behaviour[i] is not None for i in idx]
        assert mb.sampler_rows.tolist() == [behaviour[i] is None for i in idx]
        for j, i in enumerate(idx):
            want = rows[i].sampler_logps if behaviour[i] is None else torch.zeros(0)
            assert torch.equal(mb.sampler_logps[j, :len(want)], want) and not mb.sampler_logps[j, len(want):].any()
        taught = pack([teachers[i] or rows[i] for i in idx], tokenizer.pad_token_id, "cpu")[:2]
        assert all(torch.equal(x, y) for x, y in zip(mb.teacher_inputs, taught, strict=True))
        assert mb.has_teacher.tolist() == [teachers[i] is not None for i in idx]
    strip = dataclasses.replace(cfg, feedback_grad="strip")
    assert all(mb.old_logps is mb.sampling_logps for mb in update.micro_batches(
        model, ref_model, b, strip, tokenizer.pad_token_id, "cpu"))
    plain = dataclasses.replace(cfg, ppo_epochs=1, beta=0.0)
    plain_b = dataclasses.replace(b, behaviour=None, teachers=None)
    for mb in update.micro_batches(model, None, plain_b, plain, tokenizer.pad_token_id, "cpu"):
        assert (mb.old_logps, mb.ref_logps, mb.sampling_logps, mb.teacher_inputs) == (None,) * 4
        assert mb.sampler_rows.all()


def test_self_distill_and_feedback_model_terms_pass_their_settings_and_weights(tiny):
    """update.self_distill_loss against distill's functions called by hand (the divergence asked for, its
    coefficient, the batch's taught tokens, only the rows that have a teacher), 0 without a teacher; and
    update.feedback_model_loss: the principles' log-likelihood at temperature 1 whatever --temperature says,
    a padding copy (weight 0) left out, normalised by the batch's feedback tokens; the statistics of both."""
    import distill
    import forwards
    from rollout import Completion, pack

    g = torch.Generator().manual_seed(5)
    rows, width, vocab, k = 3, 4, 11, 2
    logits = torch.randn(rows, width, vocab, generator=g).requires_grad_()
    teacher_ids = torch.randint(0, vocab, (rows, width, k), generator=g)
    teacher_logps = torch.log_softmax(torch.randn(rows, width, k + 1, generator=g), dim=-1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    f = update.Forward(logits, torch.zeros(rows, width), torch.zeros(rows, width), mask, torch.zeros(rows, width),
                       teacher_logps=teacher_logps, teacher_ids=teacher_ids)
    mb = update.MicroBatch(torch.zeros(rows, 6, dtype=torch.long), torch.ones(rows, 6), mask, torch.zeros(rows),
                           mask, has_teacher=torch.tensor([True, False, True]))
    cfg = config.Config(self_distill_coef=0.3, self_distill_div="jsd", feedback_model_coef=0.2, temperature=0.7,
                        micro_batch=8)
    stats = {}
    loss = update.self_distill_loss(f, mb, cfg, {"teacher_tokens": 11}, stats)
    taught = mask * torch.tensor([1.0, 0.0, 1.0])[:, None]
    want, div = distill.self_distill_loss(distill.student_logprobs(logits, teacher_ids), teacher_logps, taught,
                                          "jsd", 0.3, 11)
    assert torch.equal(loss, want) and stats["self_distill_loss"] == [(want.item(), None)]
    assert stats["self_distill_div"] == [(pytest.approx((div.sum() / 3).item()), 3.0)]
    assert loss != distill.self_distill_loss(distill.student_logprobs(logits, teacher_ids), teacher_logps, taught,
                                             "reverse_kl", 0.3, 11)[0]  # the divergence asked for matters
    stats = {}
    assert update.self_distill_loss(f, dataclasses.replace(mb, has_teacher=torch.zeros(rows, dtype=torch.bool)),
                                    cfg, {"teacher_tokens": 11}, stats).item() == 0.0
    assert "self_distill_div" not in stats  # no taught token: no divergence to average
    assert update.self_distill_loss(dataclasses.replace(f, teacher_logps=None), mb, cfg, {}, {}) == 0.0

    model, tokenizer = tiny
    ids = lambda text: rollout.token_ids(tokenizer, text)  # noqa: E731
    texts = [(Completion(ids("Problem: 2 + 5. Attempt: 8."), ids(" Add the two numbers."), False, ""), 1.0),
             (Completion(ids("Problem: 3 * 4."), ids(" Multiply, then check the product."), False, ""), 1.0),
             (Completion(ids("Problem: 2 + 5. Attempt: 8."), ids(" Add the two numbers."), False, ""), 0.0)]
    stats = {}
    loss = update.feedback_model_loss(model, texts, cfg, {"feedback_tokens": 23}, stats, tokenizer.pad_token_id,
                                      "cpu")
    packed = pack([c for c, _ in texts], tokenizer.pad_token_id, "cpu")
    logps = forwards.token_logprobs(model, *packed, 8)[0]  # temperature 1: a supervised target
    nll = -(logps[0].sum() + logps[1].sum())
    assert loss.item() == pytest.approx(0.2 * nll.item() / 23, rel=1e-5)
    n_tokens = float(len(texts[0][0].completion_ids) + len(texts[1][0].completion_ids))
    assert stats["feedback_model_loss"] == [(loss.item(), None)]
    assert stats["feedback_model_ce"] == [(pytest.approx(nll.item() / n_tokens, rel=1e-5), n_tokens)]
    hot = -(forwards.token_logprobs(model, *packed, 8, 0.7)[0][:2].sum())
    assert abs(hot.item() - nll.item()) > 1e-3  # the temperature would change it: the check can fail


def test_entropy_with_grad_is_the_logged_entropy_with_its_graph(tiny):
    """Forward.entropy_with_grad (for a loss term of one's own): the same per-token entropies as the logged
    statistic f.entropy, 0 outside the loss mask, and a gradient that reaches the weights."""
    import prompts
    from rollout import Completion, pack

    model, tokenizer = tiny
    prompt = rollout.token_ids(tokenizer, prompts.render_prompt(tokenizer, "What is 2 + 5?", one_shot=False))
    rows = [Completion(prompt, rollout.token_ids(tokenizer, c), False, "") for c in (" 7<|im_end|>", " 2 + 5 is 7")]
    ids, attn, cmask = pack(rows, tokenizer.pad_token_id, "cpu")
    loss_mask = cmask * torch.tensor([1, 0])[:, None]  # the second row left out of the loss
    mb = update.MicroBatch(ids, attn, cmask, torch.zeros(2), loss_mask)
    cfg = config.Config(temperature=0.7)
    f = update.forward(model, mb, cfg)
    h = f.entropy_with_grad()
    torch.testing.assert_close(h, f.entropy, atol=1e-5, rtol=1e-5)
    assert h.requires_grad and not f.entropy.requires_grad and h[1].abs().sum() == 0 and h[0].sum() > 0
    model.zero_grad()
    h.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_reference_log_probs_are_the_base_model_for_lora_and_the_frozen_copy_otherwise(tiny):
    """update.reference_logprobs: with LoRA (no reference copy) the adapter-disabled model, whatever the
    adapters learned; else the reference model given; each at the sampling temperature."""
    import copy

    from peft import LoraConfig, get_peft_model

    import forwards
    import prompts
    from rollout import Completion, pack

    base, tokenizer = tiny
    lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():  # adapters that moved away from 0: the policy is no longer its base
        for name, w in lora.named_parameters():
            if "lora_B" in name:
                w.normal_(0, 0.5)
    prompt = rollout.token_ids(tokenizer, prompts.render_prompt(tokenizer, "What is 2 + 5?", one_shot=False))
    ids, attn, cmask = pack([Completion(prompt, rollout.token_ids(tokenizer, " 2 + 5 = 7"), False, "")],
                            tokenizer.pad_token_id, "cpu")
    cfg = config.Config(temperature=0.7, micro_batch=4)
    want = forwards.token_logprobs(base, ids, attn, cmask, 4, 0.7)[0]
    got = update.reference_logprobs(lora, None, ids, attn, cmask, cfg, 1, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    policy = forwards.token_logprobs(lora, ids, attn, cmask, 4, 0.7)[0]
    assert (policy - want).abs().max() > 1e-3  # the adapters do change the policy: the check can fail
    frozen = copy.deepcopy(base)
    with torch.no_grad():
        for w in frozen.parameters():
            w.mul_(1.5)
    torch.testing.assert_close(update.reference_logprobs(base, frozen, ids, attn, cmask, cfg, 1, 1),
                               forwards.token_logprobs(frozen, ids, attn, cmask, 4, 0.7)[0], atol=1e-5, rtol=1e-5)


def _hand_update(model, b, cfg, pad_id):
    """policy_update written out: per epoch every micro-batch's loss terms and the feedback texts' loss,
    backward, the norm clipped, an SGD step; the norms and summed losses it saw."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms, losses = [], []
    micro = update.micro_batches(model, None, b, cfg, pad_id, "cpu")  # pi_old: before the first step
    for _ in range(cfg.ppo_epochs):
        total = 0.0
        for mb in micro:
            loss = sum(term(update.forward(model, mb, cfg), mb, cfg, b.window, {}) for term, _ in update.LOSS_TERMS)
            loss.backward()
            total += loss.item()
        if b.feedback_texts:
            loss = update.feedback_model_loss(model, b.feedback_texts, cfg, b.window, {}, pad_id, "cpu")
            loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return norms, losses


def test_policy_update_steps_once_per_epoch_on_the_whole_batch_and_skips_what_it_must(tiny):
    """update.policy_update against the same update written out by hand (two epochs, two micro-batches and a
    feedback text each, the gradient norm clipped): the same weights after, the mean gradient norm, the loss
    summed over micro-batches and averaged over epochs, one scheduler step per epoch. A non-finite loss skips
    every step and leaves the weights; a batch with nothing to learn runs no forward at all."""
    import copy

    from accelerate import Accelerator

    import prompts
    from rollout import Completion

    model, tokenizer = tiny
    texts = [(" 7<|im_end|>", 1.0), (" 2 + 5 = 8<|im_end|>", -1.0), (" 12 - 3 = 9<|im_end|>", 0.5),
             (" 3<|im_end|>", -0.5)]
    rows = [(prompts.render_prompt(tokenizer, prompts.problem_request(p), one_shot=False), c, a)
            for p, (c, a) in zip(["What is 2 + 5?"] * 2 + ["Tom has 12 apples and eats 3."] * 2, texts)]
    completions = [Completion(rollout.token_ids(tokenizer, p), rollout.token_ids(tokenizer, c), False, c)
                   for p, c, _ in rows]
    principle = Completion(rollout.token_ids(tokenizer, "Problem: 2 + 5."), rollout.token_ids(tokenizer, " Add."),
                           False, "")
    window = {"seqs": 4.0, "tokens": float(sum(len(c.completion_ids) for c in completions)),
              "teacher_tokens": 0.0, "feedback_tokens": float(len(principle.completion_ids))}
    b = update.UpdateBatch(completions, torch.tensor([a for _, _, a in rows]), None, None, [(principle, 1.0)],
                           window, torch.ones(4))
    cfg = config.Config(micro_batch=2, ppo_epochs=2, max_grad_norm=0.05, feedback_model_coef=0.1, lr=0.1)
    by_hand = copy.deepcopy(model)
    norms, losses = _hand_update(by_hand, b, cfg, tokenizer.pad_token_id)
    assert min(norms) > 0.05  # clipping was active: the check of the clip can fail

    trained = copy.deepcopy(model)
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    steps = []
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: steps.append(s) or 1.0)
    out = update.policy_update(trained, None, opt, scheduler, Accelerator(cpu=True), b, cfg, tokenizer.pad_token_id)
    for p, q in zip(trained.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    assert out["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-5)
    assert out["loss"] == pytest.approx(sum(losses) / 2, rel=1e-5) and out["skipped_updates"] == 0.0
    assert "feedback_model_ce" in out and out["time_update"] > 0 and steps == [0, 1, 2]  # built at 0, 2 steps

    broken = copy.deepcopy(model)
    opt = torch.optim.SGD(broken.parameters(), lr=0.1)
    nan = dataclasses.replace(b, advantages=torch.tensor([float("nan"), 1.0, 0.5, -0.5]))
    out = update.policy_update(broken, None, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                               Accelerator(cpu=True), nan, cfg, tokenizer.pad_token_id)
    assert out["skipped_updates"] == 2.0 and math.isnan(out["grad_norm"])
    assert all(torch.equal(p, q) for p, q in zip(broken.parameters(), model.parameters(), strict=True))

    idle = dataclasses.replace(b, window={**window, "seqs": 0.0, "feedback_tokens": 0.0})
    assert update.policy_update(None, None, None, None, None, idle, cfg, tokenizer.pad_token_id) == {
        "time_logprob": 0.0, "time_update": 0.0, "skipped_updates": 0.0}
