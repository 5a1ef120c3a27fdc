"""Mutation score of the modules the method's correctness and its claims rest on (grpo.py, forwards.py, reflect.py,
pool.py, distill.py, prompts.py; data.py, scoring.py, abstract.py, update.py, math_grader.py, stats.py), measured
with mutmut: each mutant changes one operator, constant, argument or string, and runs
against the tests that reach the mutated function; a mutant that no test notices has survived. Prints, per
module, the mutants, how many the tests killed and the score (killed, or timed out, over all), writes the
survivors' names to --out (`mutmut show NAME` in --work prints a survivor's diff).

The tests are the unit tests: those that train or evaluate a whole run (they take the `tiny_model_dir` fixture)
are left out, so a mutant is judged in seconds; a mutant only a whole run reaches counts as not killed here.

    pip install mutmut==3.8.1           # benchmark-only dependency
    python bench/mutation.py            # all twelve modules
    python bench/mutation.py --modules reflect.py pool.py

It works in a copy of the repository under --work (mutmut writes its config and mutants/ there): the checkout
is never changed. A second run with the same --work reuses the verdicts of unchanged code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["grpo.py", "forwards.py", "reflect.py", "pool.py", "distill.py", "prompts.py",
           "data.py", "scoring.py", "abstract.py", "update.py", "math_grader.py", "stats.py"]
TESTS = ["tests/test_grpo.py", "tests/test_lanpo.py", "tests/test_prompts.py", "tests/test_distill.py",
         "tests/test_train.py", "tests/test_evaluate.py", "tests/test_data.py", "tests/test_rollout.py",
         "tests/test_grader.py", "tests/test_stats.py", "tests/test_rules.py", "tests/test_reward.py",
         "tests/test_context_probe.py"]
# the malloc test counts page faults of a child process, which mutmut's instrumented run inflates
LEFT_OUT = ["tests/test_train.py::test_cpu_host_memory_keep_reuses_freed_memory_and_return_gives_it_back"]
UNIT_ONLY = '''"""pytest plugin of bench/mutation.py: leave out the tests that train or evaluate a whole run (those
that take the tiny model's directory themselves; the in-memory model `tiny` is fine) and those in LEFT_OUT; a
name in LEFT_OUT that its collected file no longer has stops the run (a renamed test would run again)."""
import inspect

import pytest

LEFT_OUT = %r


def pytest_collection_modifyitems(config, items):
    files = {item.nodeid.split("::")[0] for item in items}
    gone = [name for name in LEFT_OUT if name.split("::")[0] in files and name not in {i.nodeid for i in items}]
    if gone:
        raise pytest.UsageError(f"bench/mutation.py: LEFT_OUT names {gone}, which the tests no longer have")
    left = [item for item in items
            if "tiny_model_dir" in inspect.signature(item.obj).parameters or item.nodeid in LEFT_OUT]
    config.hook.pytest_deselected(items=left)
    items[:] = [item for item in items if item not in left]
'''


def copy_repository(work: Path) -> list[str]:
    """The tracked files of the checkout, as they are now, into `work` (mutmut's own files there are kept);
    returns the top-level names they are under."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, work / name)
    return sorted({name.split("/")[0] + ("/" if "/" in name else "") for name in files})


def verdicts(work: Path, modules: list[str]) -> dict[str, Counter]:
    """Per module: how many mutants ended in each of mutmut's states (killed, survived, timeout, no tests...)."""
    from mutmut.stats import status_by_exit_code

    out = {}
    for module in modules:
        meta = json.loads((work / "mutants" / f"{module}.meta").read_text())
        out[module] = Counter(status_by_exit_code[code] for code in meta["exit_code_by_key"].values())
        out[module]["survivors"] = [name for name, code in meta["exit_code_by_key"].items()
                                    if status_by_exit_code[code] in ("survived", "no tests")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", nargs="+", default=MODULES, choices=MODULES)
    ap.add_argument("--work", default="runs/mutation", help="where the copy of the repository and mutants/ go")
    ap.add_argument("--out", default="runs/bench/mutation.json")
    args = ap.parse_args()

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    top = copy_repository(work)
    (work / "mutation_unit_only.py").write_text(UNIT_ONLY % LEFT_OUT)
    # mutmut runs the tests in mutants/: everything else of the repository goes there as it is
    copied = [name for name in top if name not in args.modules and name != "tests/"] + ["mutation_unit_only.py"]
    (work / "setup.cfg").write_text(
        "[mutmut]\nsource_paths =\n    " + "\n    ".join(args.modules) + "\n"
        # mutmut stops a mutant's tests after (their measured time + constant) x multiplier x 2 CPU seconds and
        # counts it killed ("timeout"). Its measured time leaves out pytest's start (importing torch and
        # transformers: ~10 CPU seconds), so with its defaults (1 s, 15) a mutant whose tests took 0.5 s was
        # stopped while still importing: a surviving mutant counted as killed. 30 s covers the start; one
        # thread per worker (OMP_NUM_THREADS=1 below) keeps CPU seconds equal to wall seconds.
        "timeout_constant = 30\ntimeout_multiplier = 2\n"
        "also_copy =\n    " + "\n    ".join(copied) + "\n"
        "pytest_add_cli_args =\n    -p\n    mutation_unit_only\n    -q\n"
        "pytest_add_cli_args_test_selection =\n    " + "\n    ".join(TESTS) + "\n")
    done = subprocess.run([sys.executable, "-m", "mutmut", "run"], cwd=work,
                          env=dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"))
    if done.returncode:
        raise SystemExit(f"mutmut run failed (exit {done.returncode}); its files are in {work}")

    result = verdicts(work, args.modules)
    print("| module | mutants | killed | timeout | survived | no tests | score |\n|---|---|---|---|---|---|---|")
    for module, c in result.items():
        total = sum(v for k, v in c.items() if k != "survivors")
        score = (c["killed"] + c["timeout"]) / total if total else float("nan")
        print(f"| {module} | {total} | {c['killed']} | {c['timeout']} | {c['survived']} | {c['no tests']} | "
              f"{score:.1%} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"survivors by name in {args.out}; `cd {work} && mutmut show NAME` prints one's diff")


if __name__ == "__main__":
    main()
