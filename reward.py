"""The numerical reward of a completion: the math grader (1 when its final answer equals the gold answer,
else 0), or a function of your own named by --reward module:function.

A reward function is f(problem: dict, completion: str) -> float. `problem` is the dataset row (`id`,
`problem`, `answer` and the file's other columns), `completion` the sampled text (after the prompt). It runs
in worker processes, so it may be slow, print, or import what it likes: a call that raises, returns no finite
number, or outlives --reward-timeout scores 0 and is counted (the step's `reward_failures`), and the first
failure of a run is printed with the problem and the error. When every call of a batch fails, the run stops
with that line: a function that never works is a bug to fix, not noise to train on. The reward only ever
reaches the advantages (and the pool's records); reflection prompts never see it.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys

import math_grader

MATH = "math"  # the default: math_grader.grade against the row's gold answer


def load(spec: str):
    """The function `module:function` names, imported here; a name that does not resolve to a callable
    stops with one line (checked before any model loads)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise SystemExit(f"--reward {spec!r}: expected '{MATH}' or module:function (a function "
                         "f(problem: dict, completion: str) -> float in an importable module)")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module beside where the run starts, as `python -m` would find it
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module's to report
        raise SystemExit(f"--reward {spec}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise SystemExit(f"--reward {spec}: {module_name} has no function {name}")
    return fn


def _serve(spec: str) -> None:
    """Worker process loop: {"problem", "completion"} per line in, {"reward"} or {"error"} per line out."""
    fn = load(spec)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # what the function prints must not corrupt the replies
    for line in sys.stdin:
        request = json.loads(line)
        try:
            value = fn(request["problem"], request["completion"])
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"returned {value!r}, not a finite number")
            reply = {"reward": float(value)}
        except Exception as e:  # noqa: BLE001 - a failing call scores 0 and is reported, the run goes on
            reply = {"error": f"{type(e).__name__}: {e}"}
        real_stdout.write(json.dumps(reply) + "\n")
        real_stdout.flush()


class Rewarder:
    """Scores completions with one reward: the math grader, or a user's function on a few worker processes
    (each call time-bounded). `failures` counts failed calls; `first_failure` describes the first."""

    def __init__(self, spec: str = MATH, timeout: float = 10.0, workers: int = math_grader.POOL_SIZE) -> None:
        self.spec, self.timeout = spec, timeout
        self.failures, self.first_failure = 0, ""
        self.workers = None
        if spec != MATH:
            load(spec)  # fails here, in one line, rather than in a worker
            path = [p or os.getcwd() for p in sys.path]  # the worker imports the module as this process does
            self.workers = math_grader.ProcessPool(workers, f"import reward; reward._serve({spec!r})",
                                                   f"--reward {spec}", path)

    def scores(self, problems: list[dict], completions: list[str], truncated: list[bool] | None = None) -> list[float]:
        """One reward per (problem row, completion text); `truncated` (cut at the token limit) reaches the math
        grader, which reads no answer from a cut that may have shortened it."""
        if self.spec == MATH:
            return math_grader.grade_batch(completions, [p["answer"] for p in problems], truncated=truncated)
        replies = self.workers.map([{"problem": _plain(p), "completion": c} for p, c in zip(problems, completions)],
                                   self.timeout)
        replies = [r if r is not None else {"error": f"no reward within --reward-timeout {self.timeout}s"}
                   for r in replies]
        failed = [(p, r["error"]) for p, r in zip(problems, replies) if "error" in r]
        self.failures += len(failed)
        if failed and not self.first_failure:
            problem, error = failed[0]
            self.first_failure = f"--reward {self.spec} failed on problem {problem.get('id')!r}: {error} (scored 0)"
            print(self.first_failure, file=sys.stderr, flush=True)
        if failed and len(failed) == len(replies):
            raise SystemExit(f"--reward {self.spec} failed on all {len(replies)} completions of a batch, e.g. "
                             f"problem {failed[0][0].get('id')!r}: {failed[0][1]}")
        return [r.get("reward", 0.0) for r in replies]

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()


def _plain(row: dict) -> dict:
    """The row as JSON carries it (a parquet column's numpy value becomes its text)."""
    return json.loads(json.dumps(row, default=str))
