"""lanpo.py end to end on a tiny random model: generate -> grade -> update, for real, several configs."""

import ctypes
import json
import platform
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

import lanpo
import rundir


def documented_metric_keys() -> set[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_0-9/]+)` \|", section, flags=re.M))


def run(tiny_model_dir, tmp_path, *extra):
    cfg = lanpo.parse_config(["--model", str(tiny_model_dir), "--out-dir", str(tmp_path / "run"),
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
    per_kind = {k for k in documented if k.endswith(("/reward", "/accuracy", "/len"))}  # only kinds present
    optional = {k for k in documented if k.startswith(("eval_", "time_eval", "distill_", "self_distill_",
                                                         "feedback_model_"))}  # eval steps; options that are off
    per_step = documented - per_kind - optional
    assert per_step <= set(records[0]), per_step - set(records[0])
    assert "eval_accuracy" in records[1]
    before, after = _params(tiny_model_dir), _params(tmp_path / "run" / "final")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)  # every weight took a gradient step
    assert (tmp_path / "run" / "checkpoints" / "step-000002" / "lanpo_state.json").exists()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["group_size"] == 4


def test_kl_and_several_epochs(tiny_model_dir, tmp_path, graded_by_parity):
    _, records = run(tiny_model_dir, tmp_path, "--beta", "0.1", "--ppo-epochs", "2", "--loss-type", "dapo")
    # the second epoch sees a moved policy: ratio != 1 and a positive KL to the frozen reference
    assert records[1]["kl"] > 0 and records[1]["ratio_mean"] != 1.0


def test_lora_uses_the_adapter_free_model_as_reference(tiny_model_dir, tmp_path, graded_by_parity):
    _, records = run(tiny_model_dir, tmp_path, "--lora-rank", "4", "--beta", "0.1", "--ppo-epochs", "2")
    assert records[1]["kl"] > 0
    assert (tmp_path / "run" / "final" / "adapter_config.json").exists()
    import evaluate  # a LoRA checkpoint evaluates as its base with the adapter merged

    bench = tmp_path / "b.jsonl"
    bench.write_text('{"id": "x", "problem": "What is 1 + 1?", "answer": "2"}\n')
    results = evaluate.main(["--model", str(tmp_path / "run" / "final"), "--benchmarks", str(bench),
                             "--max-new-tokens", "4", "--out-dir", str(tmp_path / "eval")])
    assert results["b.jsonl"]["zero-shot"]["problems"] == 1


def test_bad_flags_fail_before_compute(tiny_model_dir, tmp_path):
    with pytest.raises(SystemExit, match="does not divide"):
        lanpo.parse_config(["--batch-problems", "3", "--group-size", "4", "--micro-batch", "8"])
    with pytest.raises(SystemExit, match="not a known alias"):
        lanpo.main(lanpo.parse_config(["--model", "no-such-model", "--out-dir", str(tmp_path)]))
    with pytest.raises(SystemExit, match="no column"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"question": "1+1", "answer": "2"}\n')
        lanpo.main(lanpo.parse_config(["--model", str(tiny_model_dir), "--dataset", str(bad),
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
        lanpo.main(lanpo.parse_config(common + ["--out-dir", str(tmp_path / "a")]))
    lanpo.main(lanpo.parse_config(common + ["--out-dir", str(tmp_path / "b"), "--skip-bad-rows"]))
    out = capsys.readouterr().out
    assert "skipped 1 bad rows" in out and "'prompt_too_long': 1" in out


def test_bf16_mixed_precision_trains(tiny_model_dir, tmp_path, graded_by_parity):
    _, records = run(tiny_model_dir, tmp_path, "--dtype", "bf16-mixed")
    assert all(r["grad_norm"] > 0 and r["loss"] == r["loss"] for r in records)  # autocast path, finite
    before, after = _params(tiny_model_dir), _params(tmp_path / "run" / "final")
    assert all(v.dtype == torch.float32 for v in after.values())  # master weights stay fp32
    assert any(not torch.equal(before[k], after[k]) for k in before)


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


FREE_AND_REALLOCATE = r"""
import resource, sys
import torch
sys.path.insert(0, sys.argv[1])
import lanpo
assert lanpo.keep_freed_host_memory(), "glibc's mallopt refused a setting"
def step():  # ten 8 MB blocks, written, then all freed: what an update does to its activations
    blocks = [torch.ones(2**21) for _ in range(10)]
    del blocks
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc and Linux fault counts")
def test_cpu_steps_reuse_freed_memory_instead_of_faulting_it_back():
    """Five rounds allocate 400 MB (102,400 pages). Without keep_freed_host_memory the same process faulted
    22,000-102,000 of them back in (measured); with it, under a tenth."""
    done = subprocess.run([sys.executable, "-c", FREE_AND_REALLOCATE, str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) < 10_240


def test_without_glibc_the_run_says_freed_memory_is_not_kept(tiny_model_dir, tmp_path, graded_by_parity, monkeypatch,
                                                            capsys):
    def no_libc(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert lanpo.keep_freed_host_memory() is False
    run(tiny_model_dir, tmp_path, "--steps", "1", "--eval-every", "0")
    assert "malloc is not glibc's" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--cpu-rows-first-matmul", "--no-cpu-rows-first-matmul"])
def test_cpu_runs_decode_with_rows_first_linears_unless_told_not_to(tiny_model_dir, tmp_path, graded_by_parity,
                                                                    monkeypatch, flag):
    import models

    seen = []
    real = models.rows_first_linears
    monkeypatch.setattr(models, "rows_first_linears", lambda model: seen.append(real(model)) or seen[-1])
    run(tiny_model_dir, tmp_path, "--steps", "1", "--eval-every", "0", flag)
    assert seen == ([2 * 7 + 1] if flag == "--cpu-rows-first-matmul" else [])
