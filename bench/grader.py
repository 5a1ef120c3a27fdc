"""Grader quality and latency: `math_grader.grade` against math-verify used directly, on a labelled set
built from real gold answers (MATH-500, data/math500.jsonl): equivalent rewrites (labels: equal) and
perturbations (labels: not equal) made by rules whose label is known by construction, plus adversarial
cases. Prints a table and writes JSON.

    python bench/grader.py                 # all 500 golds
    python bench/grader.py --limit 50      # smoke run
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

import math_grader  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "math500.jsonl"


def rewrites(gold: str) -> list[tuple[str, bool, str]]:
    """(prediction, equivalent?, rule) pairs for one gold answer."""
    out = [(gold, True, "identical"), (f" {gold} ", True, "spaces"), (f"x = {gold}" if "=" not in gold else gold,
                                                                     True, "x-prefix")]
    if "\\frac" in gold:
        out.append((gold.replace("\\frac", "\\dfrac"), True, "dfrac"))
    if re.fullmatch(r"-?\d+", gold):
        n = int(gold)
        out += [(str(n + 1), False, "off-by-one"), (str(-n) if n else "1", False, "sign"),
                (f"{n}.0", True, "decimal-zero"), (f"{n - 3} + 3", False, "restated-sum")]
        factor = next((f for f in range(2, int(abs(n) ** 0.5) + 1) if n % f == 0), None)
        if factor:  # the question's arithmetic left undone is a restatement, not an answer
            out.append((f"{factor} \\times {n // factor}", False, "restated-product"))
        if abs(n) >= 1000:
            out.append((f"{n:,}", True, "thousands"))
        if n and n % 100 == 0:
            out.append((f"{n / 1000:g} \\times 10^{{3}}", True, "scientific"))
    m = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", gold)
    if m:
        value = Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
        out += [(f"{value.numerator}/{value.denominator}", True, "slash-fraction"),
                (f"\\frac{{{value.numerator * 2}}}{{{value.denominator * 2}}}", True, "unreduced"),
                (f"\\frac{{{value.numerator + 1}}}{{{value.denominator}}}", False, "numerator+1")]
        if value.denominator in (2, 4, 5, 8, 10, 20, 25, 50):
            out.append((str(float(value)), True, "decimal"))
    m = re.fullmatch(r"(\d*)\\sqrt\{?(\d+)\}?", gold)
    if m:
        k, r = int(m.group(1) or 1), int(m.group(2))
        out += [(f"\\sqrt{{{k * k * r}}}", True, "sqrt-absorbed"), (f"\\sqrt{{{k * k * r + 1}}}", False, "sqrt+1")]
    if gold.startswith("\\text{") and gold.endswith("}"):
        out.append((gold[6:-1], True, "text-unwrapped"))
    if "^\\circ" in gold:
        out.append((gold.replace("^\\circ", ""), True, "degrees-dropped"))
    return out


ADVERSARIAL = [
    ("\\frac{1}{2^{99}}", "\\frac{1}{2^{98}}", False),
    ("1-\\frac{1}{e}", "1+\\frac{1}{e}", False),
    ("10^{10^{10^{10}}}", "1", False),
    ("9" * 5000, "1", False),
    ("\\frac{" * 200 + "1" + "}{2}" * 200, "1", False),
    ("(1,2]", "[1,2)", False),
]


# Hostile answers (towers, huge factorials, limits in disguise): each must be decided by size limits or
# exact integer reasoning in well under 100 ms, never by the time bound. tests/test_grader.py checks the
# verdicts; this bench times them.
HOSTILE = [("2^{2^{1000}}", "4^{2^{999}}", True), ("2^{2^{1000}}", "2^{2^{999}}", False),
           ("2^{2^{1000}}", "16", False), ("3^{2^{1000}}", "2^{2^{1000}}", False), ("(10^{12})!", "1", False),
           ("(10^{12})!", "(10^{12})!", True), ("1000000!", "10^{100}", False), ("(1+10^{-50})^{10^{50}}", "e", False),
           ("(1+\\frac{1}{10^{50}})^{10^{50}}", "e", False), ("2^{10^{6}} - 1", "0", False),
           ("10^{10^{10}} + 1", "10^{10^{10}}", False), ("9^{9^{9}}", "3^{2 \\cdot 9^{9}}", False),
           ("2^{2^{2^{2^{2^{2^{2^{2}}}}}}}!", "1", False), ("10^{10^{10^{10}}}", "1", False)]


def cut_row(golds: list[str]) -> dict:
    """Responses cut at the token limit (graded with truncated=True): a marked answer that runs to the cut must
    score 0 even where it reads as the gold answer ("The answer is 15" may have been cut from 150); a closed
    box before the cut must score 1."""
    numbers = [g for g in golds if re.fullmatch(r"\d+", g)]
    shortened = [math_grader.grade(f"So the answer is {g}", g, truncated=True) for g in numbers]
    boxed = [math_grader.grade(f"The answer is \\boxed{{{g}}}. Let me check: {g}", g, truncated=True) for g in numbers]
    return {"cases": 2 * len(numbers), "wrong": int(sum(shortened)) + len(numbers) - int(sum(boxed))}


def hostile_row() -> dict:
    times, wrong = [], 0
    before = math_grader.timeouts()
    for pred, gold, label in HOSTILE:
        t0 = time.perf_counter()
        wrong += math_grader.grade(f"\\boxed{{{pred}}}", gold) != float(label)
        times.append(time.perf_counter() - t0)
    return {"cases": len(HOSTILE), "wrong": wrong, "max_ms": 1000 * max(times),
            "timeouts": math_grader.timeouts() - before, "slowest": HOSTILE[int(np.argmax(times))][0]}


def batch_row(n: int = 16) -> dict:
    """n symbolic checks (sqrt rewrites, distinct so no cache answers them) graded one by one and as a batch."""
    def pairs(offset):
        ks = range(offset + 2, offset + 2 + n)
        return [f"\\boxed{{{k}\\sqrt{{{p}}}}}" for k, p in zip(ks, [2, 3, 5, 7] * n)], \
               [f"\\sqrt{{{k * k * p}}}" for k, p in zip(ks, [2, 3, 5, 7] * n)]
    responses, golds = pairs(0)
    t0 = time.perf_counter()
    one_by_one = [math_grader.grade(r, g) for r, g in zip(responses, golds)]
    sequential = time.perf_counter() - t0
    responses, golds = pairs(1000)
    t0 = time.perf_counter()
    batch = math_grader.grade_batch(responses, golds)
    concurrent = time.perf_counter() - t0
    return {"checks": n, "processes": math_grader.POOL_SIZE, "sequential_s": sequential, "batch_s": concurrent,
            "all_equal": all(one_by_one) and all(batch)}


def verify_directly(pred: str, gold: str) -> bool:
    """math-verify as its README shows it (gold first), inside a try: it raises on some inputs."""
    from math_verify import parse, verify

    try:
        return bool(verify(parse(f"${gold}$"), parse(f"${pred}$")))
    except BaseException as e:  # noqa: BLE001 - its TimeoutException derives from BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=0, help="first N gold answers (0 = all)")
    ap.add_argument("--out", default="runs/bench/grader.json")
    args = ap.parse_args()
    golds = [json.loads(line)["answer"] for line in DATA.open()]
    golds = golds[:args.limit] if args.limit else golds
    cases = [(p, g, label, rule) for g in golds for p, label, rule in rewrites(g)]
    cases += [(p, g, label, "adversarial") for p, g, label in ADVERSARIAL]
    math_grader.warm_up()
    verify_directly("1", "1")  # import cost out of the timings
    results = {}
    for name, fn in (("lanpo.math_grader", lambda p, g: math_grader.grade(f"\\boxed{{{p}}}", g) == 1.0),
                     ("math-verify", verify_directly)):
        times, correct, errors_by_rule = [], 0, {}
        for pred, gold, label, rule in cases:
            t0 = time.perf_counter()
            verdict = fn(pred, gold)
            times.append(time.perf_counter() - t0)
            if verdict == label:
                correct += 1
            else:
                errors_by_rule[rule] = errors_by_rule.get(rule, 0) + 1
        results[name] = {"accuracy": correct / len(cases), "p50_ms": 1000 * float(np.median(times)),
                         "p99_ms": 1000 * float(np.percentile(times, 99)), "max_ms": 1000 * max(times),
                         "errors_by_rule": errors_by_rule}
    results["cases"] = len(cases)
    results["timeouts"] = math_grader.timeouts()
    results["hostile"] = hostile_row()
    results["cut"] = cut_row(golds)
    results["batch"] = batch_row()
    print(f"{len(cases)} labelled pairs from {len(golds)} MATH-500 gold answers")
    print("| grader | accuracy | p50 ms | p99 ms | max ms | errors by rule |")
    print("|---|---|---|---|---|---|")
    for name in ("lanpo.math_grader", "math-verify"):
        r = results[name]
        print(f"| {name} | {r['accuracy']:.4f} | {r['p50_ms']:.3f} | {r['p99_ms']:.1f} | {r['max_ms']:.0f} | "
              f"{r['errors_by_rule']} |")
    print(f"grader timeouts (scored 0): {results['timeouts']}")
    h = results["hostile"]
    print(f"hostile answers: {h['cases']} cases, {h['wrong']} wrong, {h['timeouts']} timeouts, slowest "
          f"{h['max_ms']:.1f} ms ({h['slowest']})")
    print(f"responses cut at the token limit: {results['cut']['cases']} cases, {results['cut']['wrong']} wrong")
    b = results["batch"]
    print(f"{b['checks']} symbolic checks: one by one {b['sequential_s']:.2f} s, grade_batch on {b['processes']} "
          f"processes {b['batch_s']:.2f} s (all right: {b['all_equal']})")
    common.save_json(results, args.out)


if __name__ == "__main__":
    main()
