"""Answer checking: pull the final answer out of a response and decide whether it equals the gold answer.

`grade(response, gold)` returns 1.0 or 0.0. Most answers are settled by a fast path in this process:
normalised strings; exact numbers (fractions, scientific notation, repeating decimals, spelled-out
integers); units (a unit on both sides must agree); number bases; inequalities against intervals; and
sizes no evaluation could handle (power towers, huge factorials), settled by exact integer reasoning or
as unequal. The rest go to a symbolic check (math-verify's LaTeX parser + our own comparison) in a
separate grader process, so that a hard time bound holds on any thread and inside worker processes: on
timeout the process is killed and restarted, and the answer scores 0. `grade_batch` runs a batch's
symbolic checks on a small pool of such processes at once. Model text is never executed: only
math-verify's LaTeX grammar parses it (its plain-expression mode calls sympy's `parse_expr`, i.e.
`eval`, and is not used).
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import select
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

SYMBOLIC_MAX_CHARS = 300  # longer answers are compared as strings only: no sympy on megabyte outputs
TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 120.0

# --------------------------------------------------------------------------------------------------
# Extraction


def _boxed_contents(text: str, truncated: bool = False) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...}, brace-balanced; None if absent or unbalanced. In a
    truncated text a brace-less box ("\\boxed 5") that runs to the cut is no answer: the cut may have shortened it."""
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\s*(\{)?", text)]
    for m in reversed(starts):
        if m.group(1) is None:  # "\boxed 5": the token after the command
            tok = re.match(r"\s*([^\s$\\]+)", text[m.end():])
            if tok and not (truncated and m.end() + tok.end() == len(text)):
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


def extract_answer(text: str, truncated: bool = False) -> str | None:
    """The model's final answer: the last \\boxed{}/\\fbox{}, else 'The answer is X', 'Answer: X', '#### X'.

    truncated: the text was cut at the token limit. Only an answer completed before the cut counts: a box
    whose braces close, or a marked answer with text after it. 'The answer is 1', cut from '15', is no answer."""
    boxed = _boxed_contents(text, truncated)
    if boxed is not None:
        return boxed
    for pattern in _FALLBACKS:
        # cut: an answer that runs to the end of the text, with no whitespace the model wrote after it
        matches = [m for m in pattern.finditer(text)
                   if not truncated or m.end() < len(text) or text[m.end() - 1].isspace()]
        if matches:
            return matches[-1].group(1).strip().rstrip(".").strip()
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
    s = re.sub(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |~|\\displaystyle|\\textstyle|\\scriptstyle", "", s)
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


_SCIENTIFIC = re.compile(r"^(-?(?:\d+(?:\.\d*)?|\.\d+))(?:\\times|\\cdot|\*|×)10\^(?:\{([+-]?\d+)\}|(\d))$")
_E_NOTATION = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)[eE][+-]?\d+$")
_REPEATING = re.compile(r"^(-?)(\d*)\.(\d*)\\overline\{?(\d+)\}?$")
_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_WORD_VALUES = {**{w: i for i, w in enumerate(_ONES)}, **{w: 20 + 10 * i for i, w in enumerate(_TENS)}}
_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9}
MAX_EXPONENT = 10**4  # a power or factorial past this is never evaluated


def number_from_words(text: str) -> int | None:
    """'twelve' -> 12, 'one hundred twenty-three' -> 123, 'minus five' -> -5; None unless the whole text
    is a spelled-out integer."""
    words = [w for w in re.split(r"[\s\-]+", _TEXT_CMD.sub(r"\1", text).strip().strip("$.").lower()) if w != "and"]
    sign = -1 if words and words[0] in ("minus", "negative") else 1
    words = words[1:] if sign < 0 else words
    if not words or not all(w in _WORD_VALUES or w == "hundred" or w in _SCALES for w in words):
        return None
    total, current = 0, 0
    for w in words:
        if w in _WORD_VALUES:
            current += _WORD_VALUES[w]
        elif w == "hundred":
            current = (current or 1) * 100
        else:
            total, current = total + (current or 1) * _SCALES[w], 0
    return sign * (total + current)


def exact_value(s: str) -> Fraction | None:
    """Exact value of a normalised number written as an integer, decimal, fraction, scientific notation
    (4.5\\times10^{3}, 4.5e3) or repeating decimal (0.1\\overline{6}); else None."""
    value = as_fraction(s)
    if value is not None:
        return value
    m = _SCIENTIFIC.match(s)
    if m:
        exponent = int(m.group(2) or m.group(3))
        return Fraction(m.group(1)) * Fraction(10) ** exponent if abs(exponent) <= 400 else None
    if _E_NOTATION.match(s) and abs(int(re.split("[eE]", s)[1])) <= 400:
        return Fraction(s)
    m = _REPEATING.match(s)
    if m:
        sign, whole, fixed, cycle = m.groups()
        value = Fraction(int(whole or 0)) + Fraction(int(fixed or 0), 10 ** len(fixed))
        value += Fraction(int(cycle), (10 ** len(cycle) - 1) * 10 ** len(fixed))
        return -value if sign else value
    return None


# Units: "5 \\text{cm}", "5\\,\\mathrm{m}", "12 meters". A unit on both sides must agree.
_UNIT_SYNONYMS = {
    "cm": "centimeter", "centimetre": "centimeter", "m": "meter", "metre": "meter", "km": "kilometer",
    "kilometre": "kilometer", "mm": "millimeter", "millimetre": "millimeter", "in": "inch", "inche": "inch",
    "ft": "foot", "feet": "foot", "yd": "yard", "mi": "mile", "s": "second", "sec": "second", "min": "minute",
    "h": "hour", "hr": "hour", "kg": "kilogram", "g": "gram", "mg": "milligram", "l": "liter", "litre": "liter",
    "ml": "milliliter", "millilitre": "milliliter", "lb": "pound", "oz": "ounce", "mph": "mile/hour",
    "cent": "cent", "dollar": "dollar", "unit": "unit", "degree": "degree", "day": "day", "week": "week",
    "year": "year", "month": "month"}
_BARE_UNITS = {"cm", "m", "km", "mm", "in", "ft", "yd", "mi", "s", "sec", "min", "h", "hr", "kg", "g", "mg", "l",
               "ml", "lb", "oz", "mph"} | {u + "s" for u in _UNIT_SYNONYMS.values()} | set(_UNIT_SYNONYMS.values())
_WITH_UNIT = re.compile(r"^(?P<num>-?[\d.,/]+(?:\\times10\^\{?-?\d+\}?)?)\s*"
                        r"(?:\\(?:text|mbox|mathrm)\{\s*(?P<u1>[^{}]+?)\s*\}|(?P<u2>[a-zA-Z]+))"
                        r"(?P<power>\^\{?[23]\}?)?\s*$")


def split_unit(ans: str) -> tuple[str, str | None]:
    """(the number, its unit in canonical form) for a number followed by a unit; (ans, None) otherwise."""
    if len(ans) > SYMBOLIC_MAX_CHARS:
        return ans, None
    s = re.sub(r"\\[,;: !]|~|\$", " ", ans).strip()
    m = _WITH_UNIT.match(s)
    if not m or (m.group("u2") and m.group("u2") not in _BARE_UNITS):
        return ans, None
    words = (m.group("u1") or m.group("u2")).lower().split()
    power = re.sub(r"\D", "", m.group("power") or "")
    if words and words[0] in ("square", "sq", "cubic"):
        power, words = ("2" if words[0] != "cubic" else "3"), words[1:]
    if not words:
        return ans, None
    unit = " ".join(_unit_word(w) for w in words)
    return m.group("num"), unit + (f"^{power}" if power else "")


def _unit_word(word: str) -> str:
    """'cm' -> 'centimeter', 'meters' -> 'meter': a synonym, else the singular of a plural."""
    if word in _UNIT_SYNONYMS:
        return _UNIT_SYNONYMS[word]
    if word.endswith("s") and len(word) > 3:
        return _UNIT_SYNONYMS.get(word[:-1], word[:-1])
    return word


# Number bases: 123_4, 123_{4}, (123)_{4}, -(123)_4
_BASED = re.compile(r"^(-?)\(?([0-9A-Za-z]+)\)?_\{?\(?(\d+)\)?\}?$")


def base_verdict(p: str, g: str) -> bool | None:
    """Equal digits in the same base; a different base is unequal; a bare number matches the gold's digits
    (the subscript left out) or, against a gold without a base, its value."""
    pm, gm = _BASED.match(p), _BASED.match(g)
    if not pm and not gm:
        return None
    def parts(m, s):
        if m:
            return m.group(1), m.group(2).lower().lstrip("0") or "0", int(m.group(3))
        return ("-", s[1:].lstrip("0") or "0", None) if s.startswith("-") else ("", s.lstrip("0") or "0", None)
    (ps, pd, pb), (gs, gd, gb) = parts(pm, p), parts(gm, g)
    if pb is not None and gb is not None:
        return (ps, pd, pb) == (gs, gd, gb)
    if gb is not None:  # a bare number against a based gold: the subscript left out
        return (ps, pd) == (gs, gd)
    if ps != gs or not gd.isdigit():
        return None
    try:  # a based prediction against a plain gold: its digits or its value
        return pd == gd or int(pd, pb) == int(gd)
    except ValueError:
        return False


# Intervals and inequalities: x \\ge 3 == [3,\\infty); |x-1|<2 == (-1,3); 1<x\\le3 == (1,3]
_INF = {"\\infty": math.inf, "+\\infty": math.inf, "∞": math.inf, "-\\infty": -math.inf, "-∞": -math.inf}
_COMPARISONS = [("\\leqslant", "<="), ("\\geqslant", ">="), ("\\leq", "<="), ("\\geq", ">="), ("\\le", "<="),
                ("\\ge", ">="), ("≤", "<="), ("≥", ">="), ("\\lt", "<"), ("\\gt", ">")]


def _endpoint(text: str):
    return _INF[text] if text in _INF else exact_value(text)


def interval_set(s: str, inequality: bool) -> list[tuple] | None:
    """Canonical sorted, merged (lo, lo_closed, hi, hi_closed) pieces of a normalised answer written as
    inequalities in one variable (inequality=True) or as a union of intervals; None if it is neither."""
    for latex, op in _COMPARISONS:
        s = s.replace(latex, op)
    s = s.replace("\\lvert", "|").replace("\\rvert", "|").replace("\\vert", "|")
    pieces = []
    if inequality:
        for part in re.split(r"\\text\{or\}|\\vee|\\lor|\\cup|(?<=[\d}a-z])or(?=[a-z\d|\\-])", s):
            piece = _inequality(part)
            if piece is None:
                return None
            pieces += piece
    else:
        for part in re.split(r"\\cup|∪", s):
            m = re.fullmatch(r"([(\[])([^,]+),([^,]+)([)\]])", part)
            if not m:
                return None
            lo, hi = _endpoint(m.group(2)), _endpoint(m.group(3))
            if lo is None or hi is None:
                return None
            pieces.append((lo, m.group(1) == "[", hi, m.group(4) == "]"))
    return _merged(pieces)


def _inequality(part: str) -> list[tuple] | None:
    m = re.fullmatch(r"\|([a-z])(?:([+-])([^|]+))?\|(<=|<|>=|>)(.+)", part)  # |x - c| op r
    if m:
        c = exact_value(m.group(3)) if m.group(3) else Fraction(0)
        r = exact_value(m.group(5))
        if c is None or r is None:
            return None
        c = -c if m.group(2) == "+" else c
        closed = "=" in m.group(4)
        if m.group(4).startswith("<"):
            return [(c - r, closed, c + r, closed)] if r > 0 or (closed and r == 0) else []
        return [(-math.inf, False, c - r, closed), (c + r, closed, math.inf, False)]
    tokens = re.split(r"(<=|>=|<|>)", part)
    if len(tokens) not in (3, 5) or not all(tokens):
        return None
    variables = [i for i in range(0, len(tokens), 2) if re.fullmatch(r"[a-z]", tokens[i])]
    if len(variables) != 1 or (len(tokens) == 5 and variables != [2]):
        return None
    lo, lo_closed, hi, hi_closed = -math.inf, False, math.inf, False
    v = variables[0]
    for i in range(1, len(tokens), 2):
        op, other = tokens[i], tokens[i + 1] if i + 1 != v else tokens[i - 1]
        value = _endpoint(other)
        if value is None:
            return None
        upper = op.startswith("<") if i == v + 1 else op.startswith(">")  # x < a, or a > x
        if upper:
            hi, hi_closed = value, "=" in op
        else:
            lo, lo_closed = value, "=" in op
    return [(lo, lo_closed, hi, hi_closed)]


def _merged(pieces: list[tuple]) -> list[tuple]:
    out: list[list] = []
    for lo, lo_closed, hi, hi_closed in sorted(pieces, key=lambda p: (p[0], not p[1])):
        if lo > hi or (lo == hi and not (lo_closed and hi_closed)):
            continue  # empty
        if out and (lo < out[-1][2] or (lo == out[-1][2] and (lo_closed or out[-1][3]))):
            if hi > out[-1][2] or (hi == out[-1][2] and hi_closed):
                out[-1][2], out[-1][3] = hi, hi_closed or (hi == out[-1][2] and out[-1][3])
            continue
        out.append([lo, lo_closed, hi, hi_closed])
    return [tuple(p) for p in out]


def is_inequality(s: str) -> bool:
    return bool(re.search(r"<|>|\\[lg](?:eqslant|eq|e|t)|≤|≥", s))  # normalize glued "\\le x" into "\\lex"


# Hostile sizes: towers, huge factorials and limits in disguise are settled before any evaluation


def _braced_after(s: str, i: int) -> str:
    """The exponent starting at s[i]: a {...} group (balanced) or one token."""
    if i < len(s) and s[i] == "{":
        depth = 0
        for j in range(i, len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                return s[i + 1:j]
        return s[i + 1:]
    m = re.match(r"-?\d+|[a-zA-Z]|\\[a-zA-Z]+", s[i:])
    return m.group(0) if m else ""


def too_big(s: str) -> bool:
    """A power whose exponent, or a factorial whose argument, is an integer (tower) past MAX_EXPONENT (or
    past 1000 for a factorial): evaluating it would take minutes and gigabytes."""
    for m in re.finditer(r"\^", s):
        exponent = _braced_after(s, m.end()).lstrip("+")
        value = integer_power(exponent.lstrip("-"))
        if value == HUGE or (value is not None and value > MAX_EXPONENT):
            return True
    for m in re.finditer(r"!", s):
        before = s[:m.start()]
        arg = re.search(r"(\d+)$", before)
        if arg is None and before.endswith((")", "}")):
            closing = before[-1]
            opening = "(" if closing == ")" else "{"
            depth, j = 0, len(before) - 1
            while j >= 0:
                depth += {closing: 1, opening: -1}.get(before[j], 0)
                if depth == 0:
                    break
                j -= 1
            inner = before[j + 1:-1]
            value = integer_power(inner) if inner else None
            if value == HUGE or (value is not None and value > 1000) or ("^" in inner and value is None):
                return True
        elif arg is not None and int(arg.group(1)) > 1000:
            return True
    return False


def power_key(s: str):
    """(root, exponent) of an integer power tower with base = root^k reduced, so 4^{2^{999}} and
    2^{2^{1000}} meet; None when `s` is not one or its exponent is too large to hold."""
    m = _POWER.fullmatch(s)
    if m is None or len(m.group(1)) > 100:
        return None
    exponent = integer_power(m.group(2) or m.group(3))
    if exponent is None or exponent == HUGE:
        return None
    base = int(m.group(1))
    for k in range(base.bit_length(), 1, -1):
        root = round(base ** (1 / k))
        for r in (root - 1, root, root + 1):
            if r > 1 and r ** k == base:
                return r, k * exponent
    return base, exponent


# an operator between two numbers ("23+5", "3*(4+5)", "6\\div2"); a power ("2^{10}") is a closed form
_ARITHMETIC = re.compile(r"\d\)*(?:[-+*/×·÷]|\\times|\\cdot|\\div)\(*-?\d")


def unevaluated(p: str) -> bool:
    """A normalised answer that is arithmetic left to do ("23+5", "3\\times4+5"), not a number written in one of
    exact_value's forms (a/b, 4.5\\times10^{3}, -7): against a numeric gold answer it restates, never answers."""
    return exact_value(p) is None and _ARITHMETIC.search(p) is not None


def fast_verdict(pred: str, gold: str) -> bool | None:
    """True/False when strings or exact numbers settle it, None when a symbolic check is needed."""
    (pred, p_unit), (gold, g_unit) = split_unit(pred), split_unit(gold)
    if p_unit and g_unit and p_unit != g_unit:
        return False  # metres are not centimetres; a unit on one side only is ignored
    p, g = normalize(pred), normalize(gold)
    if p == g:
        return True
    if unevaluated(p) and (exact_value(g) is not None or number_from_words(gold) is not None):
        return False  # "\\boxed{23 + 5}" for 28 echoes the question: the arithmetic is the task
    if max(len(p), len(g)) > SYMBOLIC_MAX_CHARS:  # the forms below are short; a long answer is one of none
        pf, gf = as_fraction(p), as_fraction(g)
        return pf == gf if pf is not None and gf is not None else None
    pw, gw = number_from_words(pred), number_from_words(gold)
    if pw is not None or gw is not None:
        pv = Fraction(pw) if pw is not None else exact_value(p)
        gv = Fraction(gw) if gw is not None else exact_value(g)
        if pv is not None and gv is not None:
            return pv == gv
    based = base_verdict(p, g)
    if based is not None:
        return based
    p_inequality, g_inequality = is_inequality(p), is_inequality(g)
    if p_inequality or g_inequality:
        ps, gs = interval_set(p, p_inequality), interval_set(g, g_inequality)
        if ps is not None and gs is not None:
            return ps == gs
    if too_big(p) or too_big(g):
        pk, gk = power_key(p), power_key(g)
        return pk is not None and pk == gk  # settled without evaluating: equal towers meet exactly
    pf, gf = exact_value(p), exact_value(g)
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


class TimedProcess:
    """A long-lived worker process (`python -c code`, which prints "ready" and then answers one JSON request
    per line with one JSON line) whose requests each have a time bound: one that outlives it is counted, the
    process killed and restarted on the next request. reward.py runs users' reward functions on these too
    (`ProcessPool`)."""

    def __init__(self, code: str, what: str, path: list[str] | None = None) -> None:
        self.code, self.what, self.path = code, what, path or []
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.timeouts = 0

    def _start(self) -> subprocess.Popen:
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([here, *self.path, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.Popen([sys.executable, "-c", self.code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, cwd=here, env=env)
        ready, _, _ = select.select([proc.stdout], [], [], STARTUP_TIMEOUT_S)
        if not ready or proc.stdout.readline().strip() != "ready":
            proc.kill()
            raise RuntimeError(f"{self.what}: the worker process did not start within {STARTUP_TIMEOUT_S}s")
        return proc

    def ask(self, request: dict, timeout: float) -> dict | None:
        """The reply, or None when the request outlived `timeout` seconds (or killed the process)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else ""
            if not line:
                self.timeouts += 1
                self.proc.kill()
                self.proc.wait()
                self.proc = None
                return None
            return json.loads(line)

    def close(self) -> None:
        with self.lock:
            if self.proc is not None:
                self.proc.kill()
                self.proc.wait()
                self.proc = None


class ProcessPool:
    """`size` TimedProcesses of one kind, started on first use; `ask` borrows whichever is free (waiting for
    one), so threads can keep them all busy: a batch takes about its slowest request, not the sum."""

    def __init__(self, size: int, code: str, what: str, path: list[str] | None = None) -> None:
        self.processes = [TimedProcess(code, what, path) for _ in range(size)]
        self.free: queue.Queue = queue.Queue()
        for process in self.processes:
            self.free.put(process)

    def ask(self, request: dict, timeout: float) -> dict | None:
        """TimedProcess.ask on a free process."""
        process = self.free.get()
        try:
            return process.ask(request, timeout)
        finally:
            self.free.put(process)

    def map(self, requests: list[dict], timeout: float) -> list[dict | None]:
        """Each request's reply (None: timed out), all processes working at once."""
        with ThreadPoolExecutor(len(self.processes)) as threads:
            return list(threads.map(lambda request: self.ask(request, timeout), requests))

    @property
    def timeouts(self) -> int:
        return sum(p.timeouts for p in self.processes)

    def close(self) -> None:
        for process in self.processes:
            process.close()


POOL_SIZE = max(2, min(4, os.cpu_count() or 1))
_POOL = ProcessPool(POOL_SIZE, "import math_grader; math_grader._serve()",
                    "math_grader (is math-verify installed? `pip install math-verify`)")


def _ask(pred: str, gold: str, timeout: float) -> bool:
    reply = _POOL.ask({"pred": pred, "gold": gold}, timeout)
    return reply is not None and bool(reply["ok"])


def timeouts() -> int:
    """Symbolic checks cut off by the time bound so far (each scored 0)."""
    return _POOL.timeouts


def warm_up() -> None:
    """Start the grader processes now (imports take a second or two each) rather than inside a step."""
    with ThreadPoolExecutor(POOL_SIZE) as pool:
        list(pool.map(lambda p: p.ask({"pred": "1", "gold": "1"}, TIMEOUT_S), _POOL.processes))


def grade(response: str, gold: str, timeout: float = TIMEOUT_S, truncated: bool = False) -> float:
    """1.0 if the response's final answer equals the gold answer, else 0.0; returns within ~timeout.
    truncated: the response was cut at the token limit (see extract_answer)."""
    pred = extract_answer(response, truncated)
    if pred is None or not pred.strip():
        return 0.0
    verdict = fast_verdict(pred, gold)
    if verdict is not None:
        return float(verdict)
    if len(pred) > SYMBOLIC_MAX_CHARS or len(gold) > SYMBOLIC_MAX_CHARS:
        return 0.0
    return float(_ask(pred, gold, timeout))


def grade_batch(responses: list[str], golds: list[str], timeout: float = TIMEOUT_S,
                truncated: list[bool] | None = None) -> list[float]:
    """grade() of each pair, on threads: the symbolic checks run side by side on the grader processes, so
    a batch takes about its slowest check rather than the sum of them."""
    cut = truncated if truncated is not None else [False] * len(responses)
    with ThreadPoolExecutor(POOL_SIZE) as pool:
        return list(pool.map(lambda args: grade(args[0], args[1], timeout, args[2]), zip(responses, golds, cut)))
