"""Grader quality and latency: `math_grader.grade` against math-verify used directly, on a labelled set
built from real gold answers (../shared/data/math500.jsonl): equivalent rewrites (labels: equal) and
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
import math_grader  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "math500.jsonl"


def rewrites(gold: str) -> list[tuple[str, bool, str]]:
    """(prediction, equivalent?, rule) pairs for one gold answer."""
    out = [(gold, True, "identical"), (f" {gold} ", True, "spaces"), (f"x = {gold}" if "=" not in gold else gold,
                                                                     True, "x-prefix")]
    if "\\frac" in gold:
        out.append((gold.replace("\\frac", "\\dfrac"), True, "dfrac"))
    if re.fullmatch(r"-?\d+", gold):
        n = int(gold)
        out += [(str(n + 1), False, "off-by-one"), (str(-n) if n else "1", False, "sign"),
                (f"{n}.0", True, "decimal-zero")]
        if abs(n) >= 1000:
            out.append((f"{n:,}", True, "thousands"))
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
    print(f"{len(cases)} labelled pairs from {len(golds)} MATH-500 gold answers")
    print("| grader | accuracy | p50 ms | p99 ms | max ms | errors by rule |")
    print("|---|---|---|---|---|---|")
    for name in ("lanpo.math_grader", "math-verify"):
        r = results[name]
        print(f"| {name} | {r['accuracy']:.4f} | {r['p50_ms']:.3f} | {r['p99_ms']:.1f} | {r['max_ms']:.0f} | "
              f"{r['errors_by_rule']} |")
    print(f"grader timeouts (scored 0): {results['timeouts']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
