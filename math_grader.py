"""Answer checking: pull the final answer out of a response and decide whether it equals the gold answer.

`grade(response, gold)` returns 1.0 or 0.0. Most answers are settled by a fast path in this process
(normalised strings, exact rational arithmetic). The rest go to a symbolic check (math-verify's LaTeX
parser + our own comparison) that runs in a separate grader process, so that a hard time bound holds on
any thread and inside worker processes: on timeout the process is killed and restarted, and the answer
scores 0. Model text is never executed: only math-verify's LaTeX grammar parses it (its plain-expression
mode calls sympy's `parse_expr`, i.e. `eval`, and is not used).
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import subprocess
import sys
import threading
from fractions import Fraction

SYMBOLIC_MAX_CHARS = 300  # longer answers are compared as strings only: no sympy on megabyte outputs
TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 120.0

# --------------------------------------------------------------------------------------------------
# Extraction


def _boxed_contents(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...}, brace-balanced; None if absent or unbalanced."""
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\s*(\{)?", text)]
    for m in reversed(starts):
        if m.group(1) is None:  # "\boxed 5": the token after the command
            tok = re.match(r"\s*([^\s$\\]+)", text[m.end():])
            if tok:
                return tok.group(1)
            continue
        depth, i = 1, m.end()
        while i < len(text):
            c = text[i]
            if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
                i += 2  # escaped brace \{ or \} is content, not structure
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[m.end():i].strip()
            i += 1
    return None


_FALLBACKS = [
    re.compile(r"answer is[:\s]*\$?([^\n$]{1,100}?)\$?\s*(?:\.\s|\.?$|\n)", re.IGNORECASE),
    re.compile(r"answer:\s*\$?([^\n$]{1,100}?)\$?\s*(?:\.\s|\.?$|\n)", re.IGNORECASE),
    re.compile(r"####\s*([^\n]{1,100})"),
]


def extract_answer(text: str) -> str | None:
    """The model's final answer: the last \\boxed{}/\\fbox{}, else 'The answer is X', 'Answer: X', '#### X'."""
    boxed = _boxed_contents(text)
    if boxed is not None:
        return boxed
    for pattern in _FALLBACKS:
        matches = pattern.findall(text)
        if matches:
            return matches[-1].strip().rstrip(".").strip()
    return None


# --------------------------------------------------------------------------------------------------
# Fast path: normalised strings and exact numbers

_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox|mathbf)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_NUMBER = re.compile(r"^-?(?:\d+\.?\d*|\.\d+)$")
_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_SLASH = re.compile(r"^(-?\d+)/(-?\d+)$")
_UNIT_WORDS = r"(?:[a-zA-Z]+(?:\^?\{?\d\}?)?\s*)+"


def normalize(ans: str) -> str:
    """Canonical string form: LaTeX spacing, \\left/\\right, degrees, units, 'x =' and separators removed."""
    s = ans.strip().strip("$").strip()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = re.sub(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |~|\\displaystyle", "", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|°|\\degree", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "")
    # a number followed by a unit in \text{...} is that number; \text{(C)} on its own is "(C)"
    s = re.sub(r"^(-?[\d.,/]+)\s*\\(?:text|mbox|mathrm)\{\s*" + _UNIT_WORDS + r"\}$", r"\1", s)
    s = _TEXT_CMD.sub(r"\1", s)
    s = re.sub(r"^[a-zA-Z]\s*=\s*(?=[^=]*$)", "", s)  # "x = 5" -> "5", but not an equation chain
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s


def as_fraction(s: str) -> Fraction | None:
    """Exact value of a normalised plain number: integer, decimal, a/b or \\frac{a}{b}; else None."""
    if len(s) > 60:
        return None
    try:
        if _NUMBER.match(s):
            return Fraction(s)
        m = _FRAC.match(s)
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        m = _SLASH.match(s)
        if m:
            return Fraction(int(m.group(1)), int(m.group(2)))
    except (ValueError, ZeroDivisionError):
        return None
    return None


HUGE = "huge"
_POWER = re.compile(r"(\d+)\^(?:\{(.+)\}|(\d))")


def integer_power(s: str, depth: int = 0):
    """Value of a pure integer power tower like 10^{10^{3}}, or HUGE past ~5000 digits, or None when `s`
    is not such a tower. Exact and bounded, where sympy would try to build the number and hang."""
    if s.isdigit() and len(s) <= 5000:
        return int(s)
    m = _POWER.fullmatch(s)
    if m is None or depth > 50:
        return None
    base = int(m.group(1)) if len(m.group(1)) <= 5000 else HUGE
    exponent = integer_power(m.group(2) or m.group(3), depth + 1)
    if exponent is None:
        return None
    if base in (0, 1) or exponent == 0:
        return 1 if exponent == 0 else base
    if base == HUGE or exponent == HUGE or exponent * math.log10(base) > 5000:
        return HUGE
    return base ** exponent


def fast_verdict(pred: str, gold: str) -> bool | None:
    """True/False when strings or exact numbers settle it, None when a symbolic check is needed."""
    p, g = normalize(pred), normalize(gold)
    if p == g:
        return True
    pf, gf = as_fraction(p), as_fraction(g)
    if gf is not None and pf is None and "^" in p:  # an integer power tower against a plain number
        value = integer_power(p)
        if value is not None:
            return value != HUGE and Fraction(value) == gf
    if pf is not None and gf is not None:
        return pf == gf
    if p.lower() == g.lower() and not re.search(r"[a-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", g)):
        return True
    return None


# --------------------------------------------------------------------------------------------------
# Symbolic path (runs inside the grader process)


def symbolic_equal(pred: str, gold: str) -> bool:
    """math-verify's LaTeX parse and verify, with exact-value veto of its float-tolerance false positives."""
    import sympy
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig()]
    g = parse(f"${gold}$", extraction_config=config, parsing_timeout=None)
    p = parse(f"${pred}$", extraction_config=config, parsing_timeout=None)
    if not g or not p:
        return False
    if not verify(g, p, timeout_seconds=None):  # gold first: verify is asymmetric
        return False
    ge, pe = g[0], p[0]
    # verify rounds to 6 decimals, so 1/2^99 == 1/2^98 for it; numbers must agree to 25 relative digits
    if isinstance(ge, sympy.Expr) and isinstance(pe, sympy.Expr) and ge.is_number and pe.is_number:
        a, b = sympy.N(ge, 40), sympy.N(pe, 40)
        if a.is_real and b.is_real:
            scale = max(abs(a), abs(b))
            return bool(scale == 0 or abs(a - b) <= scale * sympy.Float("1e-25", 40))
    return True


def _serve() -> None:
    """Grader process loop: one JSON request per line on stdin, one verdict per line on stdout."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a runaway sympy power fails, not swaps
    except (ImportError, ValueError, OSError):
        pass
    import math_verify  # noqa: F401 - import before "ready", so request time bounds exclude start-up

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            ok = symbolic_equal(req["pred"], req["gold"])
        except (Exception, RecursionError, MemoryError):  # noqa: BLE001 - any parser failure means "not equal"
            ok = False
        sys.stdout.write(json.dumps({"ok": ok}) + "\n")
        sys.stdout.flush()


class _GraderProcess:
    """One long-lived grader process; killed and restarted when a request outlives its time bound."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.timeouts = 0

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        proc = subprocess.Popen(
            [sys.executable, "-c", "import math_grader; math_grader._serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, cwd=os.path.dirname(os.path.abspath(__file__)), env=env,
        )
        ready, _, _ = select.select([proc.stdout], [], [], STARTUP_TIMEOUT_S)
        if not ready or proc.stdout.readline().strip() != "ready":
            proc.kill()
            raise RuntimeError(f"math_grader: the grader process did not start within {STARTUP_TIMEOUT_S}s "
                               "(is math-verify installed? `pip install math-verify`)")
        return proc

    def ask(self, pred: str, gold: str, timeout: float) -> bool:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()
            self.proc.stdin.write(json.dumps({"pred": pred, "gold": gold}) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else ""
            if not line:
                self.timeouts += 1
                self.proc.kill()
                self.proc.wait()
                self.proc = None
                return False
            return bool(json.loads(line)["ok"])


_GRADER = _GraderProcess()


def timeouts() -> int:
    """Symbolic checks cut off by the time bound so far (each scored 0)."""
    return _GRADER.timeouts


def warm_up() -> None:
    """Start the grader process now (imports take a second or two) rather than inside the first step."""
    _GRADER.ask("1", "1", TIMEOUT_S)


def grade(response: str, gold: str, timeout: float = TIMEOUT_S) -> float:
    """1.0 if the response's final answer equals the gold answer, else 0.0; returns within ~timeout."""
    pred = extract_answer(response)
    if pred is None or not pred.strip():
        return 0.0
    verdict = fast_verdict(pred, gold)
    if verdict is not None:
        return float(verdict)
    if len(pred) > SYMBOLIC_MAX_CHARS or len(gold) > SYMBOLIC_MAX_CHARS:
        return 0.0
    return float(_GRADER.ask(pred, gold, timeout))
