"""A new user's first hour: every mistake stops with one line that names the flag, row or file and what to
do, before any model is loaded and with nothing written; nothing silent."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest
import safetensors.torch
import torch
from conftest import ROOT
from test_reliability import _cmd

import config
import data
import evaluate
import lanpo
import models
import rundir


@pytest.fixture
def no_model(monkeypatch):
    """Any attempt to load a model or tokenizer fails the test: every check must come first."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded before the mistake was reported")
    monkeypatch.setattr(models, "load_policy", forbidden)
    monkeypatch.setattr(models, "load_tokenizer", forbidden)


def _refused(args: list[str], match: str, tmp_path) -> str:
    out = tmp_path / "new-run"
    if "--out-dir" not in args:
        args = [*args, "--out-dir", str(out)]
    with pytest.raises(SystemExit) as stop:
        lanpo.main(config.parse_config(["--report-to", "none", *args]))
    message = str(stop.value.code)
    assert match in message and "\n" not in message, message
    assert not out.exists(), "a refused run wrote its out-dir"
    return message


@pytest.mark.parametrize("args, flag", [
    (["--levels", "3-1"], "--levels"), (["--levels", "0-2"], "--levels"), (["--micro-batch", "-2"], "--micro-batch"),
    (["--micro-batch", "0"], "--micro-batch"), (["--lr", "-1"], "--lr"), (["--top-p", "2"], "--top-p"),
    (["--top-p", "0"], "--top-p"), (["--eps-low", "2"], "--eps-low"), (["--beta", "-1"], "--beta"),
    (["--train-size", "-3"], "--train-size"), (["--eval-every", "-1"], "--eval-every"),
    (["--save-every", "-1"], "--save-every"), (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--lora-rank", "-1"], "--lora-rank"), (["--eval-size", "-1"], "--eval-size"),
    (["--max-grad-norm", "-1"], "--max-grad-norm"), (["--weight-decay", "-0.1"], "--weight-decay")])
def test_nonsense_flags_are_refused_naming_the_flag(args, flag, no_model, tmp_path):
    with pytest.raises(SystemExit) as stop:
        config.parse_config(args)
    assert flag in str(stop.value.code)


def test_levels_parse_and_refuse():
    assert data.parse_levels("1-3") == [1, 2, 3] and data.parse_levels("2,5") == [2, 5]
    for bad in ("3-1", "0-2", "1-7", "x", ""):
        with pytest.raises(SystemExit, match="--levels"):
            data.parse_levels(bad)


def test_out_dir_problems_are_reported_before_the_model(no_model, tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)  # a finished run (one stopped before any checkpoint starts again)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    _refused(["--out-dir", str(run)], "already holds a run", tmp_path)
    (run / "run.lock").write_text(json.dumps({"pid": 1, "host": socket.gethostname()}))  # init: always alive
    _refused(["--out-dir", str(run)], "is in use by another run (pid 1 on", tmp_path)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    _refused(["--out-dir", str(a_file)], "is a file, not a directory", tmp_path)


def test_resume_without_a_checkpoint_says_so(no_model, tmp_path):
    _refused(["--out-dir", str(tmp_path / "mistyped"), "--resume"], "holds no complete checkpoint", tmp_path)
    assert not (tmp_path / "mistyped").exists()


def _fake_run(tmp_path, **settings):
    """A run directory as lanpo leaves it: config.json and one complete checkpoint."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    cfg = config.parse_config(["--out-dir", str(run), *[x for k, v in settings.items()
                                                        for x in (f"--{k.replace('_', '-')}", str(v))]])
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    return run


def test_resume_refuses_changed_training_settings_and_allows_the_rest(no_model, tmp_path):
    run = _fake_run(tmp_path, lr="1e-05")
    message = _refused(["--out-dir", str(run), "--resume", "--lr", "2e-5", "--group-size", "8"],
                       "--resume would change the run", tmp_path)
    assert "--lr 2e-05 (the run has 1e-05)" in message and "--group-size 8 (the run has 4)" in message
    # more steps, other checkpoint and logging cadence: accepted (it goes on to load the model)
    with pytest.raises(AssertionError, match="a model was loaded"):
        lanpo.main(config.parse_config(["--out-dir", str(run), "--resume", "--lr", "1e-05", "--steps", "20",
                                        "--save-every", "5", "--report-to", "none"]))
    # what the out-of-memory hints name (smaller micro- and generate batches, checkpointing): accepted too
    with pytest.raises(AssertionError, match="a model was loaded"):
        lanpo.main(config.parse_config(["--out-dir", str(run), "--resume", "--lr", "1e-05", "--micro-batch", "2",
                                        "--gen-batch", "8", "--gradient-checkpointing", "--no-share-prompt-forward",
                                        "--cpu-host-memory", "return"]))


def test_resume_dir_alone_takes_the_runs_saved_settings(no_model, tmp_path):
    run = _fake_run(tmp_path, lr="1e-05", group_size=8, feedback="reflect", max_new_tokens=12)
    saved = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**saved, "one_shot": False, "report_to": "none"}))
    cfg = config.parse_config(["--resume", str(run)])
    assert (cfg.out_dir, cfg.resume, cfg.lr, cfg.group_size, cfg.feedback, cfg.max_new_tokens, cfg.one_shot) == \
        (str(run), True, 1e-05, 8, "reflect", 12, False)
    assert config.parse_config(["--out-dir", str(run), "--resume"]) == cfg  # bare --resume: the run in --out-dir
    assert config.parse_config(["--resume", str(run), "--steps", "30"]).steps == 30  # a longer run

    def refused(args, match):
        with pytest.raises(SystemExit) as stop:
            lanpo.main(config.parse_config(args))
        assert match in str(stop.value.code) and "\n" not in str(stop.value.code), stop.value.code
        return str(stop.value.code)

    assert "--group-size 4 (the run has 8)" in refused(["--resume", str(run), "--group-size", "4"],
                                                       "--resume would change the run")
    refused(["--resume", str(run), "--out-dir", str(tmp_path / "elsewhere")], "name two directories")
    (run / "config.json").write_text(json.dumps({**saved, "kl_mode": "k2"}))
    refused(["--resume", str(run)], "does not know (kl_mode)")
    assert not (tmp_path / "elsewhere").exists() and sorted(p.name for p in run.iterdir()) == ["checkpoints",
                                                                                                "config.json"]


def test_earlier_spellings_still_parse_say_so_and_resume(no_model, tmp_path, capsys):
    """--feedback intra/inter and --inter-* became reflect/abstract and --abstract-*: the old spellings give the
    same Config with one line each, and a run saved under the old names resumes as itself."""
    old = config.parse_config(["--feedback", "intra", "--inter-mode", "raw", "--inter-candidates=2"])
    new = config.parse_config(["--feedback", "reflect", "--abstract-mode", "raw", "--abstract-candidates", "2"])
    assert old == new and config.parse_config(["--feedback=inter"]).feedback == "abstract"
    err = capsys.readouterr().err
    assert "--feedback intra is now --feedback reflect (the old value still works)" in err
    assert "--inter-mode is now --abstract-mode" in err and "--inter-candidates is now --abstract-candidates" in err
    run = _fake_run(tmp_path, feedback="abstract", abstract_candidates=2)
    saved = json.loads((run / "config.json").read_text())
    saved.update(feedback="inter", inter_candidates=saved.pop("abstract_candidates"),
                  inter_mode=saved.pop("abstract_mode"))
    (run / "config.json").write_text(json.dumps(saved))
    cfg = config.parse_config(["--resume", str(run)])
    assert (cfg.feedback, cfg.abstract_candidates) == ("abstract", 2) and rundir.changed_settings(cfg, run) == ""


def test_resume_refuses_more_steps_under_a_decaying_schedule(no_model, tmp_path):
    run = _fake_run(tmp_path, lr_schedule="cosine")
    _refused(["--out-dir", str(run), "--resume", "--lr-schedule", "cosine", "--steps", "20"],
             "--steps 20 (the run has 10)", tmp_path)


def test_bad_data_is_reported_before_the_model_and_writes_nothing(no_model, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n{"id": "b", "problem": "", "answer": "3"}\n')
    _refused(["--dataset", str(rows)], f"{rows}: line 2 has an empty", tmp_path)
    text = tmp_path / "rows.txt"
    text.write_text("1+1?\t2\n")
    _refused(["--dataset", str(text)], "unsupported file type .txt", tmp_path)


def test_csv_files_load_and_columns_come_from_every_row(tmp_path):
    table = tmp_path / "problems.csv"
    table.write_text("id,problem,answer\n1,What is 2+2?,4\n2,\"What is 3, plus 1?\",4\n3,Empty answer?,\n")
    with pytest.raises(SystemExit, match="line 4 has an empty"):
        data.load_problems(str(table), "train")
    rows, skipped = data.load_problems(str(table), "train", skip_bad=True)
    assert [r["problem"] for r in rows] == ["What is 2+2?", "What is 3, plus 1?"]
    assert skipped["empty_or_non_string"] == 1
    first_row_lacks_answer = tmp_path / "rows.jsonl"
    first_row_lacks_answer.write_text("\n".join([json.dumps({"id": "0", "problem": "no answer here"})] + [
        json.dumps({"id": str(i), "problem": f"{i} + 1?", "answer": str(i + 1)}) for i in range(1, 20)]))
    rows, skipped = data.load_problems(str(first_row_lacks_answer), "train", skip_bad=True)
    assert len(rows) == 19 and skipped["empty_or_non_string"] == 1


def test_benchmark_names_work_for_training_too():
    rows, _ = data.load_problems("gsm8k_train", "train", size=5)  # the train split's file, by its name
    assert len(rows) == 5 and all(r["answer"] for r in rows)
    assert [r["id"] for r in rows] == [f"gsm8k_train-{i:04d}" for i in range(1, 6)]


def _one_line_failure(args: list[str], env_extra: dict, tmp_path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    done = subprocess.run([sys.executable, str(ROOT / "lanpo.py"), "--out-dir", str(tmp_path / "out"),
                           "--report-to", "none", *args], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "out").exists()
    return done.stderr.strip().splitlines()[-1]


def test_unreachable_hub_model_or_dataset_is_one_line(tmp_path):
    closed = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}  # a port nothing listens on
    line = _one_line_failure(["--model", "nobody-here/no-model"], closed, tmp_path)
    assert "--model nobody-here/no-model: the Hugging Face Hub cannot be reached" in line and "HF_HUB_OFFLINE" in line
    line = _one_line_failure(["--model", "nobody-here/no-model"], {"HF_HUB_OFFLINE": "1"}, tmp_path)
    assert "not in the local cache and HF_HUB_OFFLINE forbids downloading it" in line
    line = _one_line_failure(["--dataset", "nobody-here/no-data"], closed, tmp_path)
    assert "--dataset nobody-here/no-data: the Hugging Face Hub cannot be reached" in line


def _fake_wandb(monkeypatch, fail_when):
    modes = []

    def init(**kwargs):
        modes.append(kwargs["mode"])
        if fail_when(kwargs["mode"]):
            raise RuntimeError("No API key configured. Use `wandb login` to log in.\nmore lines")
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return modes


def test_wandb_auto_never_stops_a_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: not logged in
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    acc = types.SimpleNamespace(is_main_process=True, print=print)
    cfg = config.parse_config(["--out-dir", str(tmp_path / "run")])  # --report-to auto
    modes = _fake_wandb(monkeypatch, fail_when=lambda mode: mode != "offline")
    assert rundir.start_wandb(cfg, acc) is not None and modes == ["offline"]
    assert "wandb: offline (no API key; `wandb sync" in capsys.readouterr().out
    _fake_wandb(monkeypatch, fail_when=lambda mode: True)
    assert rundir.start_wandb(cfg, acc) is None
    assert "wandb: off (No API key configured. Use `wandb login` to log in.)" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: `import wandb` raises ImportError
    assert rundir.start_wandb(cfg, acc) is None
    assert "wandb: off (not installed: pip install wandb); metrics go to" in capsys.readouterr().out


def test_report_to_wandb_problems_come_before_the_model(no_model, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    with pytest.raises(SystemExit, match="wandb is not installed: pip install wandb"):
        lanpo.main(config.parse_config(["--out-dir", str(tmp_path / "run"), "--report-to", "wandb"]))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "wandb" else real_find_spec(name, *a))
    with pytest.raises(SystemExit, match="wandb has no API key: run `wandb login`"):
        lanpo.main(config.parse_config(["--out-dir", str(tmp_path / "run"), "--report-to", "wandb"]))
    assert not (tmp_path / "run").exists()


def test_model_paths_that_are_no_model_are_named_or_followed(tiny_model_dir, tmp_path, monkeypatch):
    """A run directory as --model loads its final/ (it holds the run's own config.json, which is no model's),
    an unfinished one says where the weights are; a missing path says so instead of 'not a known alias'."""
    import shutil

    import models

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.json").write_text('{"dtype": "auto", "feedback": "both"}')
    with pytest.raises(SystemExit, match=f"--model {run}: a run directory whose run has not finished"):
        models.resolve(str(run))
    shutil.copytree(tiny_model_dir, run / "final")
    assert models.resolve(str(run)) == (str(run / "final"), {})
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)  # runs/ is here: runs/no-such-run is a mistyped path, not a hub id
    for missing in ("/no/such/dir", "./nope", "runs/no-such-run"):
        with pytest.raises(SystemExit, match=f"--model {missing}: no such directory or file"):
            models.resolve(missing)
    assert models.resolve("Qwen/Qwen2.5-7B") == ("Qwen/Qwen2.5-7B", {})  # an owner/name hub id


def test_ctrl_c_stops_cleanly_and_says_how_to_resume(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(tiny_model_dir, out, "--slow", "--steps", "50"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 120
    while not (out / "checkpoints" / "step-000002").exists() and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]  # the shell's code for Ctrl-C
    assert "interrupted. Continue from" in err and f"run lanpo.py with --resume {out} (the settings are saved)" in err
    assert "\ninterrupted. Continue from" in err  # on a line of its own, not after the progress bar's last one


def test_evaluate_refusals_and_intermediate_checkpoints(tiny_model_dir, tmp_path, graded_by_parity):
    base = ["--benchmarks", "synthetic:arith", "--max-new-tokens", "4"]
    with pytest.raises(SystemExit, match="--limit must be >= 0"):
        evaluate.main(["--model", str(tiny_model_dir), *base, "--limit", "-3", "--out-dir", str(tmp_path / "e")])
    run = tmp_path / "run"
    lanpo.main(config.parse_config(["--model", str(tiny_model_dir), "--out-dir", str(run), "--steps", "2",
                                    "--save-every", "1", "--batch-problems", "2", "--group-size", "4",
                                    "--micro-batch", "4", "--max-new-tokens", "8", "--eval-every", "0",
                                    "--report-to", "none", "--lr", "1e-2"]))
    step1 = run / "checkpoints" / "step-000001"
    results = evaluate.main(["--model", str(step1), *base, "--limit", "2", "--out-dir", str(tmp_path / "e")])
    assert results["synthetic:arith"]["zero-shot"]["problems"] == 2
    trained = models.load_policy(str(step1), torch.float32)
    initial = models.load_policy(str(tiny_model_dir), torch.float32).state_dict()
    saved = safetensors.torch.load_file(step1 / "model.safetensors")
    for name, weight in trained.state_dict().items():  # the checkpoint's weights, not the base model's
        assert torch.equal(weight, saved[name]) and not torch.equal(weight, initial[name]), name
    with pytest.raises(SystemExit, match="already holds an evaluation"):
        evaluate.main(["--model", str(step1), *base, "--limit", "2", "--out-dir", str(tmp_path / "e")])
    (step1 / "config.json").unlink()  # as in a LoRA or sharded run's checkpoint
    with pytest.raises(SystemExit, match="evaluate the run's final/ directory instead"):
        evaluate.main(["--model", str(step1), *base, "--limit", "2", "--out-dir", str(tmp_path / "e2")])


def _arm(root, name, *flags):
    """A run directory as the arm `name` of the matrix with these flags would have left it."""
    out = root / name
    cfg = config.parse_config(["--out-dir", str(out), "--lr", "2e-5", *flags])
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    return out


def test_ablate_skips_finished_arms_resumes_interrupted_ones_and_refuses_other_settings(tmp_path):
    finished = _arm(tmp_path, "lanpo", "--feedback", "both", "--steps", "2")
    (finished / "final").mkdir()
    (_arm(tmp_path, "reflect-only", "--feedback", "reflect", "--steps", "2") / "checkpoints" / "step-000001").mkdir(
        parents=True)
    other = _arm(tmp_path, "grpo", "--feedback", "none", "--steps", "2", "--lr", "2e-6")
    (other / "final").mkdir()
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    done = subprocess.run(["bash", str(ROOT / "run.sh"), "ablate", "--steps", "2", "--dry-run"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, ABLATE_DIR=str(tmp_path)))
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and lines[0] == f"19 arms, each into {tmp_path}/<name> (extra flags: --steps 2):"
    assert len(lines) == 20, done.stdout + done.stderr
    assert f"  lanpo: finished with these settings, skipped ({finished})" in lines
    assert f"  reflect-only (resume): python lanpo.py --resume {tmp_path}/reflect-only --lr 2e-5 --feedback reflect " \
           "--steps 2" in lines
    assert f"  grpo: refused: {other} holds a run of other settings (--lr 2e-05 (the run has 2e-06)); move it " \
           "away to run this arm" in lines
    assert f"  abstract-only (new): python lanpo.py --out-dir {tmp_path}/abstract-only --lr 2e-5 --feedback abstract " \
           "--steps 2" in lines
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # a dry run starts and writes nothing


def test_ablate_runs_its_arms_then_extends_then_skips_them(tmp_path, tiny_model_dir):
    """./run.sh ablate for real on two arms (--arms) of the tiny model: both train; asked for more steps, both
    resume from their last checkpoint and add the missing steps; asked again, both are skipped. Unknown arm
    names stop it in one line."""
    def ablate(steps: int):
        done = subprocess.run(
            ["bash", str(ROOT / "run.sh"), "ablate", "--arms=grpo,lanpo", "--model", str(tiny_model_dir),
             "--steps", str(steps), "--batch-problems", "2", "--group-size", "2", "--micro-batch", "2",
             "--max-new-tokens", "4", "--synthetic-size", "2", "--eval-every", "0", "--no-eval-at-start",
             "--relevance-threshold", "0", "--abstract-max-tokens", "4", "--report-to", "none", "--save-every", "1"],
            capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ, ABLATE_DIR=str(tmp_path)))
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        return done.stdout.splitlines()

    def steps(arm: str) -> list[int]:
        return [json.loads(line)["step"] for line in (tmp_path / arm / "metrics.jsonl").read_text().splitlines()]

    lines = ablate(1)
    assert lines[0].startswith(f"2 arms, each into {tmp_path}/<name>") and "  grpo (new): " in lines[1][:14]
    assert steps("grpo") == steps("lanpo") == [1]
    assert json.loads((tmp_path / "lanpo" / "config.json").read_text())["feedback"] == "both"
    lines = ablate(2)
    assert lines[1].startswith(f"  grpo (resume): python lanpo.py --resume {tmp_path}/grpo --lr 2e-5 --feedback none")
    assert steps("grpo") == steps("lanpo") == [1, 2]
    lines = ablate(2)
    assert lines[1:] == [f"  grpo: finished with these settings, skipped ({tmp_path}/grpo)",
                         f"  lanpo: finished with these settings, skipped ({tmp_path}/lanpo)"]


def test_ablate_refuses_an_unknown_arm_before_any_set_up(tmp_path):
    """From a copy of run.sh and the ablation table with no .venv: one line naming the arm and the arms there
    are, exit 2, and no .venv made (nothing installed for a typo)."""
    import shutil

    shutil.copy(ROOT / "run.sh", tmp_path / "run.sh")
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "ablations.tsv", tmp_path / "configs" / "ablations.tsv")
    done = subprocess.run(["bash", str(tmp_path / "run.sh"), "ablate", "--arms=grpo,nope"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("--arms: no arm named nope (the arms: grpo lanpo ")
    assert not (tmp_path / ".venv").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the machine without GPUs")
@pytest.mark.parametrize("recipe, gpus", [("lanpo-7b", "8 GPUs"), ("small-gpu", "a GPU")])
def test_gpu_recipes_stop_in_one_line_without_gpus(recipe, gpus):
    done = subprocess.run(["bash", str(ROOT / "run.sh"), recipe], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"recipe {recipe} runs on {gpus}, and torch sees no GPU here: ./run.sh runs the embedded " \
                          "default on CPU\n"


def test_plot_steps_are_integers(tmp_path, monkeypatch):
    import matplotlib.figure

    import plot

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    plot.plot({"run": [[{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.2}]]}, tmp_path / "p.png")
    ticks = saved[0].axes[0].get_xticks()
    assert all(float(t).is_integer() for t in ticks)


def test_run_sh_with_flags_only_is_the_default_run_and_keeps_the_previous_one(tmp_path):
    """`./run.sh --flag ...` (as docs/benchmarks.md quotes it) is the default run with those flags, not an unknown
    recipe; an earlier runs/default is moved aside, said with its size. run.sh is run from a copy whose lanpo.py
    prints its arguments and whose .venv is this interpreter (no install, no training)."""
    import shutil

    shutil.copy(ROOT / "run.sh", tmp_path / "run.sh")
    (tmp_path / "lanpo.py").write_text("import sys\nprint('ARGS', sys.argv[1:])\n")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, script in [("python", f'exec {sys.executable} "$@"'), ("ruff", "true"),
                         ("pip", "echo 'the test must not install anything' >&2; exit 1")]:
        (bin_dir / name).write_text(f"#!/bin/sh\n{script}\n")
        (bin_dir / name).chmod(0o755)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    (tmp_path / "runs" / "default").mkdir(parents=True)
    (tmp_path / "runs" / "default" / "metrics.jsonl").write_text("{}\n")
    done = subprocess.run(["bash", str(tmp_path / "run.sh"), "--steps", "1", "--reflect-source", "any"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    want = ["--out-dir", "runs/default", "--lr", "2e-5", "--steps", "1", "--reflect-source", "any"]
    assert f"ARGS {want}" in done.stdout
    moved = [p.name for p in (tmp_path / "runs").iterdir() if p.name.startswith("default.")]
    assert len(moved) == 1 and f"previous runs/default moved to runs/{moved[0]} (" in done.stdout
    assert (tmp_path / "runs" / moved[0] / "metrics.jsonl").read_text() == "{}\n"  # nothing lost


def test_a_mistyped_flag_value_is_one_line(capsys):
    import evaluate
    for parse in (lambda: config.parse_config(["--loss-type", "grpoo"]), lambda: evaluate.main(["--mode", "zero"])):
        with pytest.raises(SystemExit) as stop:
            parse()
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert "invalid choice" in err and err.strip().endswith("(--help lists the flags)")
