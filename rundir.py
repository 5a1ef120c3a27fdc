"""The run directory: one run at a time (a lock file), what is in it decides whether a run may start (a used
--out-dir is refused; a run that stopped before its first checkpoint is started again; --resume must not
change the training), checkpoints written atomically, metrics and held-out lines appended one at
a time and cut back on resume, wandb started or explained, and Ctrl-C or running out of memory turned into a
line naming what to resume from. Nothing already written is lost.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import filecmp
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import torch

from pool import ExperiencePool


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a .tmp dir is a save that was cut short and is ignored)."""
    root = out_dir / "checkpoints"
    return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")) if root.exists() else []


def save_checkpoint(accelerator, out_dir: Path, step: int, keep_last: int, pool: ExperiencePool,
                    lessons_cache: dict, policy, tokenizer) -> Path:
    """Model, optimizer, scheduler and RNG states via accelerate, the step, the experience pool and the
    lessons cache; written to a .tmp dir and renamed, so a kill mid-save never shadows the previous good
    checkpoint. Where the weights are one plain model.safetensors (not LoRA, not sharded), the model config
    and tokenizer go beside them, so the checkpoint is also a model directory evaluate.py can load."""
    final = out_dir / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()  # every process's shards and RNG states are in tmp before the rename
        if accelerator.is_main_process:
            (tmp / "lanpo_state.json").write_text(json.dumps({"step": step}))
            if (tmp / "model.safetensors").exists() and not hasattr(policy, "peft_config"):
                policy.config.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
            pool.save(tmp / "pool.jsonl")
            (tmp / "lessons_cache.json").write_text(json.dumps(lessons_cache))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in checkpoint_dirs(out_dir)[:-keep_last]:
                shutil.rmtree(old)
    except OSError as e:  # disk full, permissions, quota: say where, keep every earlier checkpoint
        earlier = [p.name for p in checkpoint_dirs(out_dir)]
        raise SystemExit(f"cannot write checkpoint {tmp}: {e.strerror or e}. Earlier checkpoints are intact: "
                         f"{earlier or 'none'}") from None
    accelerator.wait_for_everyone()
    return final


def save_final(out_dir: Path, step: int, policy, tokenizer, state_dict) -> Path:
    """out_dir/final: the weights (in the dtype they were trained in), config and tokenizer as a model
    directory. Written beside and then swapped in, so a new final never writes into the file of an old one;
    where the checkpoint of the same step holds the same weights file byte for byte, final/ hard-links it
    instead of keeping a second copy (a default run: 540 of 2,150 MB)."""
    final, tmp = out_dir / "final", out_dir / "final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    weights, saved = tmp / "model.safetensors", out_dir / "checkpoints" / f"step-{step:06d}" / "model.safetensors"
    if weights.exists() and saved.exists() and filecmp.cmp(weights, saved, shallow=False):
        with contextlib.suppress(OSError):  # a file system without hard links keeps the copy
            os.link(saved, weights.with_suffix(".link"))
            os.replace(weights.with_suffix(".link"), weights)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def append_metrics(path: Path, record: dict) -> None:
    """One JSON line, flushed to disk before the next step (a kill can tear only this line)."""
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise SystemExit(f"cannot append to {path}: {e.strerror or e}") from None


SAMPLE_CHARS = 400  # of each response in samples.md: enough to see what the model wrote, small enough to read


def samples_table(rows: list[tuple[str, str, str, float]]) -> str:
    """(kind, problem, response, reward or verdict) rows as a markdown table, each text cut at SAMPLE_CHARS."""
    def cell(text: str) -> str:
        text = text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS] + " [...]"
        return text.replace("|", "\\|").replace("\n", " ⏎ ")
    lines = ["| kind | problem | response | score |", "|---|---|---|---|"]
    return "\n".join(lines + [f"| {kind} | {cell(problem)} | {cell(response)} | {score:g} |"
                              for kind, problem, response, score in rows])


def append_samples(path: Path, step: int, rows: list[tuple[str, str, str, float]]) -> None:
    """The samples table under a "step N" heading, appended: what the model wrote, readable without a tracker."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"## step {step}\n\n{samples_table(rows)}\n\n")
    except OSError as e:
        raise SystemExit(f"cannot append to {path}: {e.strerror or e}") from None


def truncate_metrics(path: Path, done_steps: int) -> None:
    """On resume, drop lines of steps after the checkpoint (they run again), so each step appears once."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= done_steps:
                kept.append(line)
        except (json.JSONDecodeError, KeyError):  # a line torn by the kill that interrupted the run
            continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


# settings that change memory use, float order or how sampling's random draws are batched, never the algorithm:
# a resumed run may change them (the out-of-memory hints name them), and bench/learning.py reuses a result made
# under other values of them
MEMORY_ONLY = ("micro_batch", "gen_batch", "gradient_checkpointing", "update_chunks", "share_prefill",
               "share_prompt_forward", "cpu_rows_first_matmul", "cpu_host_memory")
# settings a resumed run may change: its training stays the same
RESUMABLE = ("resume", "out_dir", "steps", "save_every", "keep_last", "final_checkpoint", "eval_every",
             "eval_at_start", "report_to", "wandb_project", "max_bad_updates", *MEMORY_ONLY)


LOCK = "run.lock"  # {"pid", "host"} of the process whose run writes the directory


def lock_holder(out_dir: Path) -> str | None:
    """Who else holds the directory's lock ("pid 123 on host"), or None when nobody does: no lock, this
    process's own, or one left by a process of this host that is gone (killed). A lock of another host, or one
    being written, counts as held."""
    try:
        holder = json.loads((out_dir / LOCK).read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError):
        return "a process that is writing its lock"
    if holder == {"pid": os.getpid(), "host": socket.gethostname()}:
        return None
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return None  # stale: that process died without removing its lock
        except PermissionError:
            pass  # alive, another user's
    return f"pid {holder.get('pid')} on {holder.get('host')}"


def claim(out_dir: Path) -> None:
    """Make this process the directory's only writer (creating it): the lock is created exclusively, so of two
    runs started together one wins and the other stops with a line naming the winner; it is removed when this
    process exits. A stale lock (see lock_holder) is taken over."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK
    if path.exists() and lock_holder(out_dir) is None:  # stale (this process holds no lock yet)
        path.unlink(missing_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        raise SystemExit(f"{out_dir} is in use by another run ({lock_holder(out_dir)}): choose another --out-dir, "
                         f"or wait for it to end (its lock: {path})") from None
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
    atexit.register(release, out_dir)  # however the process ends, short of a kill


def release(out_dir: Path) -> None:
    """Remove the directory's lock if this process holds it (a forked child runs its parent's exit handlers
    too, and a second run in this process may hold it by now)."""
    try:
        mine = json.loads((out_dir / LOCK).read_text()) == {"pid": os.getpid(), "host": socket.gethostname()}
    except (OSError, json.JSONDecodeError):
        return
    if mine:
        (out_dir / LOCK).unlink(missing_ok=True)


def unstarted_run(out_dir: Path) -> bool:
    """What a run leaves when it stops before its first checkpoint: its files, but nothing to resume from and
    no final model (and nobody running it)."""
    left = any((out_dir / name).exists() for name in ("config.json", "metrics.jsonl", "heldout.jsonl"))
    return left and not checkpoint_dirs(out_dir) and not (out_dir / "final").exists()


# settings earlier versions named otherwise: a run saved by one resumes, and their flags still parse
RENAMED_SETTINGS = {"inter_mode": "abstract_mode", "inter_candidates": "abstract_candidates"}
RENAMED_VALUES = {"feedback": {"intra": "reflect", "inter": "abstract"}}


def read_settings(out_dir: Path) -> dict:
    """The run's config.json in today's names and values ({} when it has none)."""
    if not (out_dir / "config.json").exists():
        return {}
    saved = json.loads((out_dir / "config.json").read_text())
    saved = {RENAMED_SETTINGS.get(name, name): value for name, value in saved.items()}
    for name, values in RENAMED_VALUES.items():
        if name in saved:
            saved[name] = values.get(saved[name], saved[name])
    return saved


def saved_settings(out_dir: Path, known: list[str]) -> dict:
    """The settings of the run in out_dir (its config.json; {} when it has none, which check_out_dir reports),
    less where it is and that it was resumed. A setting this version of lanpo does not know stops here: the
    run cannot be continued as it was."""
    path = out_dir / "config.json"
    try:
        saved = read_settings(out_dir)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"--resume: cannot read the run's settings {path}: {e}") from None
    unknown = sorted(set(saved) - set(known))
    if unknown:
        raise SystemExit(f"--resume: {path} has settings this version of lanpo does not know ({', '.join(unknown)}): "
                         "the run was made by another version; continue it with that one")
    return {name: value for name, value in saved.items() if name not in ("resume", "out_dir")}


def check_out_dir(cfg, out_dir: Path) -> Path | None:
    """The checkpoint to resume from (None: a new run), or an error before anything is written: --out-dir
    is a file; another run is writing it; it holds a run but --resume is missing; --resume finds no
    checkpoint there; or --resume with settings that differ from the run's config.json and would change its
    training (each one named). A run that stopped before its first checkpoint is started again (said here;
    its files are replaced once the run may write)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise SystemExit(f"--out-dir {out_dir} is a file, not a directory: choose another --out-dir")
    holder = lock_holder(out_dir)
    if holder is not None:
        raise SystemExit(f"{out_dir} is in use by another run ({holder}): choose another --out-dir, or wait for it "
                         f"to end (its lock: {out_dir / LOCK}); nothing there was changed")
    found = checkpoint_dirs(out_dir)
    if unstarted_run(out_dir):
        return None
    if not cfg.resume:
        if (out_dir / "metrics.jsonl").exists() or (out_dir / "heldout.jsonl").exists() or found:
            raise SystemExit(f"{out_dir} already holds a run (metrics.jsonl, heldout.jsonl or checkpoints): pass "
                             "--resume to continue it, or choose another --out-dir; nothing there was changed")
        return None
    if not found:
        raise SystemExit(f"--resume: {out_dir} holds no complete checkpoint (checkpoints/step-*): check the "
                         "path, or drop --resume to start a new run there")
    changed = changed_settings(cfg, out_dir)
    if changed:
        raise SystemExit(f"--resume would change the run: {changed}. Keep the run's settings "
                         f"({out_dir / 'config.json'}) or start a new --out-dir")
    return found[-1]


def changed_settings(cfg, out_dir: Path) -> str:
    """The settings of cfg that differ from the run in out_dir (its config.json) and would change its
    training, as "--flag value (the run has value), ..."; "" when none do."""
    saved = read_settings(out_dir)
    changed = [name for name, value in dataclasses.asdict(cfg).items()
               if name in saved and name not in RESUMABLE and saved[name] != value]
    if saved.get("steps", cfg.steps) != cfg.steps and cfg.lr_schedule != "constant":
        changed.append("steps")  # the decay is spread over --steps: more steps change the LR of the rest
    return ", ".join(f"--{n.replace('_', '-')} {getattr(cfg, n)} (the run has {saved[n]})" for n in changed)


def ablation_arm(cfg) -> str:
    """What `./run.sh ablate` does with one arm (cfg: its settings, out_dir: its directory): "new" (nothing
    there, or a run that stopped before its first checkpoint, which lanpo.py starts again), "skip" (finished
    with these settings and steps), "resume" (interrupted after a checkpoint, or finished with fewer steps),
    or a one-line refusal when the directory holds a run of other settings (never touched)."""
    out_dir = Path(cfg.out_dir)
    if not (out_dir / "config.json").exists() or unstarted_run(out_dir):
        return "new"
    changed = changed_settings(cfg, out_dir)
    if changed:
        return f"refused: {out_dir} holds a run of other settings ({changed}); move it away to run this arm"
    saved_steps = json.loads((out_dir / "config.json").read_text()).get("steps", 0)
    if (out_dir / "final").exists() and saved_steps >= cfg.steps:
        return "skip"
    if checkpoint_dirs(out_dir):
        return "resume"
    return f"refused: {out_dir} holds a finished run of {saved_steps} steps without a checkpoint to extend"


def wandb_logged_in() -> bool:
    """An API key in the environment or in ~/.netrc (where `wandb login` puts it)."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_wandb(cfg) -> None:
    """--report-to wandb needs the package and, unless WANDB_MODE says offline, a login: said before the
    model loads. (auto never stops a run: see start_wandb.)"""
    if cfg.report_to != "wandb" or os.environ.get("WANDB_MODE") == "disabled":
        return
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise SystemExit("--report-to wandb, but wandb is not installed: pip install wandb (or --report-to none)")
    if os.environ.get("WANDB_MODE") != "offline" and not wandb_logged_in():
        raise SystemExit("--report-to wandb, but wandb has no API key: run `wandb login`, set WANDB_API_KEY, or "
                         "WANDB_MODE=offline (or --report-to auto, which logs offline)")


def check_tensorboard(cfg) -> None:
    """--report-to tensorboard needs the package: said before the model loads."""
    import importlib.util

    if cfg.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise SystemExit("--report-to tensorboard, but tensorboard is not installed: pip install tensorboard "
                         "(or --report-to none)")


def start_tensorboard(cfg, accelerator):
    """A TensorBoard writer into <out_dir>/tensorboard under --report-to tensorboard (main process), else None."""
    if cfg.report_to != "tensorboard" or not accelerator.is_main_process:
        return None
    from torch.utils.tensorboard import SummaryWriter

    log_dir = Path(cfg.out_dir) / "tensorboard"
    accelerator.print(f"tensorboard: tensorboard --logdir {log_dir}")
    return SummaryWriter(log_dir=str(log_dir))


def tensorboard_log(writer, record: dict, step: int) -> None:
    """Every number of a metrics line as a scalar at `step` (the same keys as metrics.jsonl)."""
    for key, value in record.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            writer.add_scalar(key, value, step)
    writer.flush()


def start_wandb(cfg, accelerator):
    """The wandb run, or None. auto: online when logged in, else offline (synced later with `wandb sync`),
    off when wandb is missing or fails to start; one line says which. WANDB_MODE always wins."""
    if cfg.report_to in ("none", "tensorboard") or not accelerator.is_main_process \
            or os.environ.get("WANDB_MODE") == "disabled":
        return None
    try:
        import wandb
    except ImportError:  # (check_wandb stopped --report-to wandb already: this is auto)
        accelerator.print(f"wandb: off (not installed: pip install wandb); metrics go to "
                          f"{Path(cfg.out_dir) / 'metrics.jsonl'} only")
        return None
    mode = os.environ.get("WANDB_MODE") or ("online" if wandb_logged_in() else "offline")
    try:
        run = wandb.init(project=cfg.wandb_project, config=dataclasses.asdict(cfg), dir=cfg.out_dir,
                         name=Path(cfg.out_dir).name, resume="allow", mode=mode)
    except Exception as e:  # noqa: BLE001 - any wandb failure: auto goes on without it, wandb says why
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if cfg.report_to == "wandb":
            raise SystemExit(f"--report-to wandb: wandb could not start: {reason}") from None
        accelerator.print(f"wandb: off ({reason}); metrics go to {Path(cfg.out_dir) / 'metrics.jsonl'} only")
        return None
    accelerator.print(f"wandb: {mode}" + ("" if mode != "offline" else
                                          f" (no API key; `wandb sync {Path(cfg.out_dir) / 'wandb'}` uploads it)"))
    return run


def interrupted(out_dir: Path):
    """SIGINT handler: stop with one line that says what to resume from, instead of a traceback from
    wherever Ctrl-C landed (a checkpoint cut short is a .tmp dir, never loaded)."""
    def stop(signum, frame):
        saved = checkpoint_dirs(out_dir)
        print(f"\ninterrupted. Continue from {saved[-1]}: run lanpo.py with --resume {out_dir} (the settings are saved)"
              if saved
              else "\ninterrupted before the first checkpoint (--save-every N writes them): nothing to resume; the "
                   "same command starts the run again in its place",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)  # 130: the shell's code for a run stopped by Ctrl-C
    return stop


@contextlib.contextmanager
def oom_hint(phase: str, remedy: str, out_dir: Path):
    """Turn an accelerator out-of-memory error into a message that says what to change."""
    try:
        yield
    except torch.OutOfMemoryError:
        saved = [p.name for p in checkpoint_dirs(out_dir)]
        raise SystemExit(f"out of memory during {phase}: try {remedy}. Checkpoints so far: {saved or 'none'} "
                         f"(resume with --resume)") from None
