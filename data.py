"""Problems to train and evaluate on: built-in procedural generators (`synthetic:arith`, the embedded
default; `synthetic:rules`, hidden-rule families where experience must help, and `synthetic:rules-menu` and
`synthetic:rules-choice`, the same as multiple choice among values or among rules, so that chance successes teach
GRPO too), the benchmark files that ship
in the repository's data/ by name (`math500`, `aime24`, `gsm8k`, `math_train`, ...; data/README.md gives each
one's source and licence), local .jsonl/.jsonl.gz/.json/.csv files, and parquet files or hub datasets through
`datasets`.

Every loader returns a list of dicts with string fields `id`, `problem`, `answer` (and `level`, `content`
for the generators, `family` for synthetic:rules). Rows are validated on load; a bad row is an error that
names the file and the row.
"""

from __future__ import annotations

import csv
import difflib
import functools
import gzip
import json
import random
import re
from collections import Counter
from pathlib import Path

import hub

DATA_DIR = Path(__file__).resolve().parent / "data"  # the benchmark files of the repository
BENCHMARKS = {"math500": "math500.jsonl", "aime24": "aime24.jsonl", "aime25": "aime25.jsonl",
              "amc23": "amc23.jsonl", "gsm8k": "gsm8k_test.jsonl", "math": "math_test.jsonl.gz",
              "gsm8k_train": "gsm8k_train.jsonl.gz", "math_train": "math_train.jsonl.gz"}
NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Ken", "Zoe"]
ARITH_LEVELS = 6
RULES_LEVELS = 3
FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".csv")
THINGS = ["apples", "pencils", "stickers", "marbles", "books", "coins", "cards", "shells"]


def _arith_problem(rng: random.Random, level: int) -> tuple[str, int, str]:
    """One arithmetic problem of the given difficulty level (1 = easiest; level L needs L-ish steps or digits):
    (text, answer, content). `content` is the arithmetic whatever the wording, operands of + and * sorted
    ("+ 5 23" for "What is 23 + 5?" and for "Tom has 23 apples and gets 5 more ..."): two problems with the
    same content are one problem to a learner, so splits and retrieval compare contents, not texts.
    Pass rates of SmolLM2-135M-Instruct at T=1 with the one-shot prompt are in the README."""
    r = rng.randint
    name, thing = rng.choice(NAMES), rng.choice(THINGS)

    def content(op: str, *operands: int) -> str:
        return " ".join([op, *map(str, operands if op == "-" else sorted(operands))])

    if level == 1:  # one single-digit operation
        a, b = r(1, 9), r(1, 9)
        op, value = rng.choice([("+", a + b), ("*", a * b)])
        return rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}."]), value, content(op, a, b)
    if level == 2:  # carry into the tens
        a, b = r(10, 49), r(1, 9)
        return rng.choice([f"What is {a} + {b}?", f"{name} has {a} {thing} and gets {b} more. "
                                                  f"How many {thing} does {name} have now?"]), a + b, content("+", a, b)
    if level == 3:  # two two-digit numbers
        a, b = r(10, 99), r(10, 99)
        if rng.random() < 0.5:
            return f"What is {a} + {b}?", a + b, content("+", a, b)
        a, b = max(a, b), min(a, b)
        return f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b, content("-", a, b)
    if level == 4:  # three terms
        a, b, c = r(2, 30), r(2, 30), r(2, 30)
        return (f"{name} has {a} {thing}, buys {b} more, then finds {c} more. How many {thing} now?", a + b + c,
                content("+", a, b, c))
    if level == 5:  # multiply then add
        a, b, c = r(2, 9), r(2, 9), r(1, 20)
        return (f"{name} buys {a} bags with {b} {thing} in each, then gets {c} more. How many {thing}?", a * b + c,
                f"{content('*', a, b)} + {c}")
    if level == 6:  # multiply then subtract, two-digit factors
        a, b, c = r(2, 12), r(2, 12), r(2, 9)
        c = min(c, a * b - 1)
        return (f"{name} has {a} boxes of {b} {thing} and gives away {c} {thing}. "
                f"How many {thing} are left?"), a * b - c, f"{content('*', a, b)} - {c}"
    raise ValueError(f"synthetic:arith has levels 1-{ARITH_LEVELS}, got {level}")


def synthetic_arith(split: str, size: int, seed: int, levels: list[int], train_size: int = 2000) -> list[dict]:
    """`size` problems with levels drawn uniformly from `levels`, deterministic in (split, seed). No two
    problems of a split share their content key (operands and answer: "2 + 2" and "2 * 2" are one problem,
    since a solution of either shows the other's answer), so none has a twin in other words for retrieval to
    show, and N held-out problems are N distinct ones. Any other split than train never shares a content key
    with the `train_size` train problems of the same seed, whatever the wording, and no split holds the
    worked example's arithmetic (every prompt shows its answer). A level whose distinct problems are used up
    (level 1 has 88) is no longer drawn; none left is an error."""
    for level in levels:
        if not 1 <= level <= ARITH_LEVELS:
            raise SystemExit(f"--levels: synthetic:arith has levels 1-{ARITH_LEVELS}, got {level}")
    seen = {ONE_SHOT_KEY}  # content keys unseen in training and not yet here
    if split != "train":
        seen |= {content_key(row) for row in synthetic_arith("train", train_size, seed, levels)}
    rng = random.Random(f"arith-{split}-{seed}")
    rows, open_levels = [], list(levels)
    while len(rows) < size:
        level = rng.choice(open_levels)  # drawn first, so held-out splits keep the level mix of the train split
        for _ in range(1000):
            problem, answer, arithmetic = _arith_problem(rng, level)
            row = {"id": f"arith-{split}-{len(rows):05d}", "problem": problem, "answer": str(answer),
                   "level": level, "content": arithmetic}
            key = content_key(row)
            if key not in seen:
                seen.add(key)
                rows.append(row)
                break
        else:  # this level's distinct problems are used up (level 1 has 90): draw from the others
            open_levels.remove(level)
            if not open_levels:
                raise SystemExit(f"synthetic:arith cannot make {size} distinct {split} problems"
                                 f"{'' if split == 'train' else ' unseen in training'} at levels {levels}: ask for "
                                 "fewer, or add harder levels (more distinct problems)")
    return rows


# synthetic:rules: made-up operations whose rule no problem states. A family is a name ("the zorp of 7 and 3",
# "the grand zorp of 7 and 3"); its rule is one of RULE_FORMULAS, assigned to the names by the seed. Names share
# words (zorp / grand zorp), so lexical retrieval returns other families' problems beside a problem's own and
# the relevance judge has something to decide.
RULE_NOUNS = ("zorp", "blick", "fleem", "quib")
RULE_FAMILIES = tuple(f"{adjective}{noun}" for noun in RULE_NOUNS for adjective in ("", "grand "))
RULE_FORMULAS = {  # a family's hidden rule: two operands -> the answer (no plain a+b, a-b or a*b)
    "a + b + 10": lambda a, b: a + b + 10, "a * b - 1": lambda a, b: a * b - 1,
    "2 * a + b": lambda a, b: 2 * a + b, "a * b + a": lambda a, b: a * b + a,
    "a + 3 * b": lambda a, b: a + 3 * b, "a * a + b": lambda a, b: a * a + b,
    "10 * a + b": lambda a, b: 10 * a + b, "a + b + a * b": lambda a, b: a + b + a * b,
}
RULE_OPERANDS = {1: (2, 9), 2: (10, 19), 3: (20, 49)}  # level -> both operands' range
RULE_TEMPLATES = ("What is the {family} of {a} and {b}?", "Compute the {family} of {a} and {b}.",
                  "Find the {family} of {a} and {b}.")
ONE_SHOT_ANSWER = "7"  # prompts.ONE_SHOT's answer: no synthetic:rules problem has it (every prompt shows it)


def rule_families(seed: int) -> dict[str, str]:
    """Family name -> its rule's formula: a seeded one-to-one assignment (the same for every split)."""
    formulas = random.Random(f"rules-{seed}").sample(sorted(RULE_FORMULAS), len(RULE_FAMILIES))
    return dict(zip(RULE_FAMILIES, formulas))


RULE_CHOICES = 4  # rules synthetic:rules-choice lists for a family: a guess is right about one time in four


def rule_choices(seed: int) -> dict[str, list[str]]:
    """Family name -> the rules synthetic:rules-choice lists for it: its own and RULE_CHOICES - 1 others, drawn
    by the seed apart from the families' order, sorted so the list says nothing of which is the family's."""
    rules = rule_families(seed)
    rng = random.Random(f"rules-choices-{seed}")
    return {family: sorted([rule, *rng.sample(sorted(set(RULE_FORMULAS) - {rule}), RULE_CHOICES - 1)])
            for family, rule in rules.items()}


def synthetic_rules(split: str, size: int, seed: int, levels: list[int], train_size: int = 2000, *,
                    menu: str = "") -> list[dict]:
    """`size` hidden-rule problems ("What is the grand zorp of 7 and 3?"): a positive control for learning
    from experience, not evidence about math. Every split draws from the same families (rule_families(seed)),
    as evenly as `size` allows, so held-out problems are new members of training families: a solved member
    shows the rule that the problem text never states. Deterministic in (split, seed); rows carry `family`,
    `content` and a worked `solution` ("The zorp of 3 and 4 is 3 + 4 + 10 = 17. ..."): what a solved member
    shows (bench/context_probe.py's `--pool gold`; training never reads it). Levels (RULE_OPERANDS) are drawn
    uniformly per problem.
    Guards: no two problems of a split share an answer within a family (so no family repeats its operands,
    in either order), no held-out answer is the answer of any of the first `train_size` train problems of the
    same seed (the pool a held-out problem is shown holds training problems only), and none is the worked
    example's answer. A held-out problem's answer can still appear as an operand of another problem.
    `menu="values"` (synthetic:rules-menu) makes each problem multiple choice: after the question, the
    distinct values of all eight rules at its operands, in an order drawn apart from the family ("What is the
    zorp of 9 and 9? It is one of: 36, 99, 28, 27, 80, 90."). The text still does not say which rule is the
    family's, but a guess among the options is right one time in six to eight, so GRPO alone can learn the task
    from chance successes. The options are other numbers any problem may show, as operands are. A success
    there is mostly a lucky pick, so the model's own solved trials do not show the rule.
    `menu="rules"` (synthetic:rules-choice) lists candidate rules instead: the family's and RULE_CHOICES - 1
    others, the same for every member of a family (rule_choices(seed)) and shuffled per problem ("What is the
    zorp of 9 and 3? The zorp of a and b is given by one of these rules: a * b - 1, a + b + 10, 2 * a + b,
    a * a + b. Apply the right one to a = 9, b = 3 and give the number."; the request asks for the number
    because, asked only which rule, the model boxes a formula, which the grader refuses). A success has to
    compute one listed rule, and the candidates' values at the operands are distinct, so a solved trial shows
    which rule the family follows: the model's own successes carry the rule, as a worked solution does. The
    guard draws fewer operands: at levels 1-2 with 48 training problems, 104-121 held out over seeds 0-4."""
    for level in levels:
        if level not in RULE_OPERANDS:
            raise SystemExit(f"--levels: synthetic:rules has levels 1-{RULES_LEVELS}, got {level}")
    if menu not in ("", "values", "rules"):
        raise ValueError(f"menu must be '', 'values' or 'rules', got {menu!r}")
    rules = rule_families(seed)
    choices = rule_choices(seed)
    forbidden = {ONE_SHOT_ANSWER}
    if split != "train":
        forbidden |= {r["answer"] for r in synthetic_rules("train", train_size, seed, levels, menu=menu)}
    rng = random.Random(f"rules-{split}-{seed}")
    menu_rng = random.Random(f"rules-menu-{split}-{seed}")  # its own draws: the menu's order says nothing
    order = rng.sample(RULE_FAMILIES, len(RULE_FAMILIES))
    taken: dict[str, set[str]] = {family: set() for family in RULE_FAMILIES}
    rows = []
    for n in range(size):
        family = order[n % len(order)]
        for _ in range(1000):
            level = rng.choice(levels)
            a, b = rng.randint(*RULE_OPERANDS[level]), rng.randint(*RULE_OPERANDS[level])
            answer = str(RULE_FORMULAS[rules[family]](a, b))
            # a listed rule's value must name it: a wrong rule that happens to give the answer would be a success
            # that shows no rule (only for the rules' menu, so the other variants keep their rows)
            named = menu != "rules" or len({RULE_FORMULAS[f](a, b) for f in choices[family]}) == RULE_CHOICES
            if answer not in forbidden and answer not in taken[family] and named:
                break
        else:
            raise SystemExit(f"synthetic:rules cannot make {size} distinct {split} problems"
                             f"{'' if split == 'train' else ' unseen in training'} at levels {levels}: family "
                             f"{family!r} has no unused answer left; ask for fewer, or add harder levels")
        taken[family].add(answer)
        text = rng.choice(RULE_TEMPLATES).format(family=family, a=a, b=b)
        if menu == "values":
            options = sorted({rule(a, b) for rule in RULE_FORMULAS.values()})
            text += f" It is one of: {', '.join(map(str, menu_rng.sample(options, len(options))))}."
        elif menu == "rules":
            listed = menu_rng.sample(choices[family], RULE_CHOICES)
            text += (f" The {family} of a and b is given by one of these rules: {', '.join(listed)}. Apply the right "
                     f"one to a = {a}, b = {b} and give the number.")
        worked = re.sub(r"\b[ab]\b", lambda m: str({"a": a, "b": b}[m.group()]), rules[family])
        solution = f"The {family} of {a} and {b} is {worked} = {answer}. The answer is \\boxed{{{answer}}}."
        rows.append({"id": f"rules-{split}-{n:05d}", "problem": text, "answer": answer, "level": level,
                     "content": f"{family} {a} {b}", "family": family, "solution": solution})
    return rows


SYNTHETIC = {"synthetic:arith": (synthetic_arith, ARITH_LEVELS), "synthetic:rules": (synthetic_rules, RULES_LEVELS),
             "synthetic:rules-menu": (functools.partial(synthetic_rules, menu="values"), RULES_LEVELS),
             "synthetic:rules-choice": (functools.partial(synthetic_rules, menu="rules"), RULES_LEVELS)}

_SPACING = re.compile(r"\\[,;:! ]|\\q?quad(?![a-zA-Z])|\s+")
_LAYOUT = re.compile(r"\\(?:left|right|displaystyle)(?![a-zA-Z])|[${}.,;:!?]")
_NUMBERS = re.compile(r"\d+(?:\.\d+)?")
REWORDED_OVERLAP = 0.65  # word-set Jaccard above which two problems with the same answer and numbers are one


def twin_text(text: str) -> str:
    """A problem's text as twin checks compare it: problem_key, lower-cased, without `$`, braces, \\left,
    \\right and punctuation ("Find $x+y$." and "find x + y" are one problem)."""
    return _LAYOUT.sub("", problem_key(text).lower())


def content_key(row: dict) -> str:
    """A generated problem's operands and answer ("2 5 = 7" for "What is 2 + 5?" and "Tom has 5 apples and
    gets 2 more ..."): two problems with one key are one problem to a learner, since a solution of either shows
    the other's answer ("2 + 2" and "2 * 2"). "" for rows without `content` (data files)."""
    if "content" not in row:
        return ""
    return " ".join(sorted(_NUMBERS.findall(row["content"]), key=float)) + " = " + row["answer"]


ONE_SHOT_KEY = content_key({"content": "2 5", "answer": "7"})  # prompts.ONE_SHOT's "What is 2 + 5?"


def twin_keys(problem: str, key: str) -> list[str]:
    """What makes two problems one: the same twin_text, or the same content key (`key`; generated rows)."""
    return ["text " + twin_text(problem)] + (["content " + key] if key else [])


def held_out_twins(train_rows: list[dict], eval_rows: list[dict]) -> list[tuple[str, str, str]]:
    """(training id, held-out id, how) for each training problem that is a held-out one in other words: the
    same twin_keys (text; or operands and answer), or reworded (the same answer and the same non-empty set of
    numbers, with word sets overlapping by REWORDED_OVERLAP or more, Jaccard: "xy = 24, xz = 48, yz = 72 ...
    find x + y + z" / "... what is the value of x + y + z")."""
    owner = {key: row["id"] for row in eval_rows for key in twin_keys(row["problem"], content_key(row))}
    by_answer: dict[str, list[tuple[dict, set, frozenset]]] = {}
    for row in eval_rows:
        by_answer.setdefault(_SPACING.sub("", row["answer"]), []).append(
            (row, set(terms(row["problem"])), frozenset(_NUMBERS.findall(row["problem"]))))
    twins = []
    for row in train_rows:
        same = next((k for k in twin_keys(row["problem"], content_key(row)) if k in owner), None)
        if same is not None:
            twins.append((row["id"], owner[same], "same " + same.split(" ", 1)[0]))
            continue
        words, numbers = set(terms(row["problem"])), frozenset(_NUMBERS.findall(row["problem"]))
        for other, other_words, other_numbers in by_answer.get(_SPACING.sub("", row["answer"]), ()):
            if numbers and numbers == other_numbers and \
                    len(words & other_words) >= REWORDED_OVERLAP * len(words | other_words):
                twins.append((row["id"], other["id"], "reworded"))
                break
    return twins


_TERM = re.compile(r"\\[a-zA-Z]+|[a-zA-Z]+|\d+|[^\sa-zA-Z\d]")


def terms(text: str) -> list[str]:
    """Lexical terms: words (lower-cased), numbers, LaTeX commands and single symbols (the retriever's, and the
    reworded-twin check's)."""
    return [t.lower() for t in _TERM.findall(text)]


def problem_key(text: str) -> str:
    """A problem's text without whitespace and LaTeX spacing commands (\\, \\; \\quad ...): two problems
    with the same key are the same problem (data files refuse the second; retrieval never shows one for the
    other)."""
    return _SPACING.sub("", text)


def load_problems(spec: str, split: str, *, size: int = 0, seed: int = 0, levels: list[int] | None = None,
                  train_size: int = 2000, id_field: str = "id", problem_field: str = "problem",
                  answer_field: str = "answer", skip_bad: bool = False,
                  data_dir: Path = DATA_DIR) -> tuple[list[dict], Counter]:
    """Problems from `spec`: 'synthetic:arith', a benchmark name (its file in `data_dir`), a local file, or a
    hub data set (owner/name or hub:<id>; split = its split), and the count of skipped rows by reason (empty
    unless `skip_bad`).
    size > 0 keeps the first `size` rows (files) or generates that many (synthetic; held-out splits avoid
    the first `train_size` train problems)."""
    if spec.startswith("synthetic:"):
        if spec not in SYNTHETIC:
            raise SystemExit(f"--dataset {spec}: the built-in generators are {', '.join(SYNTHETIC)}")
        generate, level_count = SYNTHETIC[spec]
        levels = levels or list(range(1, level_count + 1))
        return generate(split, size or train_size, seed, levels, train_size), Counter()
    if spec.startswith("hub:"):  # explicitly a hub data set, even where a file or name of that spelling exists
        records = read_hub(spec[4:], split)
    else:
        if spec in BENCHMARKS:
            spec = str(benchmark_path(spec, data_dir))
        elif "/" not in spec and file_kind(Path(spec)) not in FILE_SUFFIXES and not Path(spec).exists():
            close = difflib.get_close_matches(spec, BENCHMARKS, n=1)
            if close:  # a typo of a name, not a hub data set (those are owner/name, or hub:<id>)
                raise SystemExit(f"{spec}: no such benchmark; did you mean {close[0]}? (names: "
                                 f"{', '.join(BENCHMARKS)}; a hub data set is owner/name or hub:<id>)")
        records = read_records(spec, split)
    rows, skipped = validate_rows(records, spec, id_field, problem_field, answer_field, skip_bad)
    return (rows[:size] if size else rows), skipped


def benchmark_path(name: str, data_dir: Path) -> Path:
    path = Path(data_dir) / BENCHMARKS[name]
    if not path.is_file():
        where = "the repository's data/" if Path(data_dir) == DATA_DIR else f"--data-dir {data_dir}"
        raise SystemExit(f"benchmark {name}: {BENCHMARKS[name]} not found in {where}; give a file path instead")
    return path


def file_kind(path: Path) -> str:
    """The FILE_SUFFIXES entry a file name ends with ('.jsonl.gz' before '.gz'), or its plain suffix."""
    return next((s for s in FILE_SUFFIXES if path.name.endswith(s)), path.suffix)


def read_records(spec: str, split: str) -> list[tuple[str, dict]]:
    """(where, record) pairs; `where` names the row in messages ('line 7' of a .jsonl, else 'row 6').
    JSON Lines are parsed here, line by line, so a broken line is named; parquet and hub data go
    through `datasets`."""
    path = Path(spec)
    kind = file_kind(path)
    if kind in FILE_SUFFIXES or path.exists():
        if kind not in FILE_SUFFIXES:
            raise SystemExit(f"{spec}: unsupported file type {kind or '(none)'}: use "
                             f"{', '.join(FILE_SUFFIXES)}")
        if not path.is_file():
            raise SystemExit(f"{spec}: file not found")
        if path.stat().st_size == 0:
            raise SystemExit(f"{spec}: the file is empty")
    if kind == ".csv":
        try:
            with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not a column
                reader = csv.DictReader(f)
                return [(f"line {reader.line_num}", row) for row in reader]
        except (UnicodeDecodeError, csv.Error) as e:
            raise SystemExit(f"{spec}: not a readable UTF-8 CSV file ({e})") from None
    if kind in (".jsonl", ".jsonl.gz"):
        try:
            raw_bytes = gzip.decompress(path.read_bytes()) if kind == ".jsonl.gz" else path.read_bytes()
        except (OSError, EOFError) as e:
            raise SystemExit(f"{spec}: not a readable gzip file ({e})") from None
        records = []
        for line_no, raw in enumerate(raw_bytes.removeprefix(b"\xef\xbb\xbf").splitlines(), 1):  # BOM
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SystemExit(f"{spec}: line {line_no} is not valid UTF-8 (byte {e.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{spec}: line {line_no} is not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise SystemExit(f"{spec}: line {line_no} is not a JSON object")
            records.append((f"line {line_no}", record))
        return records
    if kind == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8-sig"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SystemExit(f"{spec}: not valid UTF-8 JSON ({e})") from None
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise SystemExit(f"{spec}: expected a JSON list of objects")
        return [(f"item {i}", r) for i, r in enumerate(data)]
    if kind != ".parquet":
        return read_hub(spec, split)
    from datasets import load_dataset

    try:
        table = load_dataset("parquet", data_files=str(path), split="train")
    except Exception as e:  # noqa: BLE001 - any load failure of user data becomes one clear message
        raise SystemExit(f"{spec}: cannot be loaded: {type(e).__name__}: {e}") from None
    return [(f"row {i}", r) for i, r in enumerate(table)]


def read_hub(dataset_id: str, split: str) -> list[tuple[str, dict]]:
    """A hub data set's split through `datasets` (cached, or reachable: else one line, see hub.require)."""
    from datasets import load_dataset

    hub.require(dataset_id, "dataset", "--dataset", "README.md")
    try:
        table = load_dataset(dataset_id, split=split)
    except Exception as e:  # noqa: BLE001 - any load failure of user data becomes one clear message
        raise SystemExit(f"{dataset_id}: cannot be loaded: {type(e).__name__}: {e}") from None
    return [(f"row {i}", r) for i, r in enumerate(table)]


def validate_rows(records: list[tuple[str, dict]], source: str, id_field: str, problem_field: str,
                  answer_field: str, skip_bad: bool) -> tuple[list[dict], Counter]:
    """Rows as {id, problem, answer} strings. A row with a missing, empty or non-string problem or answer
    (numbers are accepted as answers), a repeated id, or a repeated problem (the same `problem_key`: text up to
    whitespace and LaTeX spacing) stops the run with a message naming source and row, or, with `skip_bad`, is
    dropped and counted."""
    if not records:
        raise SystemExit(f"{source}: no rows")
    columns = {name for _, record in records for name in record}  # a column only some rows have still counts
    for flag, name in (("--problem-field", problem_field), ("--answer-field", answer_field)):
        if name not in columns:
            raise SystemExit(f"{source}: no column {name!r} ({flag}); columns are {sorted(columns)}")
    rows, seen_ids, seen_problems, skipped = [], set(), {}, Counter()

    def bad(where: str, reason: str, message: str) -> None:
        if not skip_bad:
            raise SystemExit(f"{source}: {where} {message} (--skip-bad-rows drops such rows)")
        skipped[reason] += 1

    for index, (where, row) in enumerate(records):
        problem, answer = row.get(problem_field), row.get(answer_field)
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        broken = [name for name, value in ((problem_field, problem), (answer_field, answer))
                  if not isinstance(value, str) or not value.strip()]
        if broken:
            bad(where, "empty_or_non_string", f"has an empty, missing or non-string {broken[0]!r}: "
                                              f"{row.get(broken[0])!r}")
            continue
        raw_id = row.get(id_field)
        row_id = str(raw_id) if raw_id is not None else f"row-{index:06d}"
        if row_id in seen_ids:
            bad(where, "duplicate_id", f"repeats id {row_id!r}")
            continue
        key = problem_key(problem)
        if key in seen_problems:
            bad(where, "duplicate_problem", f"repeats the problem of id {seen_problems[key]!r} (the same text "
                                            "up to whitespace and LaTeX spacing)")
            continue
        seen_ids.add(row_id)
        seen_problems[key] = row_id
        rows.append({"id": row_id, "problem": problem.strip(), "answer": answer.strip()})
    if not rows:
        raise SystemExit(f"{source}: no usable rows ({dict(skipped)})")
    return rows, skipped


def parse_levels(text: str) -> list[int]:
    """'1-3' -> [1, 2, 3]; '1,4' -> [1, 4]; every level in 1..ARITH_LEVELS."""
    try:
        if "-" in text:
            lo, hi = text.split("-")
            levels = list(range(int(lo), int(hi) + 1))
        else:
            levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--levels {text!r}: expected a range like 1-3 or a list like 1,2,5") from None
    if not levels or not all(1 <= level <= ARITH_LEVELS for level in levels):
        raise SystemExit(f"--levels {text!r}: synthetic:arith has levels 1-{ARITH_LEVELS}; a range goes "
                         "from low to high (e.g. 1-3)")
    return levels


def load_rows(cfg) -> tuple[list[dict], list[dict], Counter]:
    """The problems of a run's settings (cfg: config.Config): training problems, held-out problems (none when
    never evaluated) and the rows skipped: bad rows, and training problems that twin a held-out one
    (`twin_of_held_out`; --eval-overlap refuse stops instead)."""
    levels = parse_levels(cfg.levels)
    train_size = cfg.synthetic_size if cfg.dataset.startswith("synthetic:") else cfg.train_size
    fields = {"id_field": cfg.id_field, "problem_field": cfg.problem_field, "answer_field": cfg.answer_field}
    fields["data_dir"] = Path(cfg.data_dir) if cfg.data_dir else DATA_DIR
    train_rows, skipped = load_problems(cfg.dataset, cfg.split, size=train_size, seed=cfg.seed, levels=levels,
                                        skip_bad=cfg.skip_bad_rows, **fields)
    eval_spec = cfg.eval_dataset or (cfg.dataset if cfg.dataset.startswith("synthetic:") else "")
    eval_rows = load_problems(eval_spec, cfg.eval_split, size=cfg.eval_size, seed=cfg.seed, levels=levels,
                              train_size=train_size, **fields)[0] if eval_spec and cfg.eval_every else []
    twins = held_out_twins(train_rows, eval_rows)
    if twins and cfg.eval_overlap == "refuse":
        shown = ", ".join(f"{t} = {e} ({how})" for t, e, how in twins[:5])
        raise SystemExit(f"--dataset {cfg.dataset}: {len(twins)} training problems are held-out problems of "
                         f"{eval_spec} in other words: {shown}{' ...' if len(twins) > 5 else ''} "
                         "(--eval-overlap drop trains without them)")
    if twins:
        dropped = {t for t, _, _ in twins}
        train_rows = [r for r in train_rows if r["id"] not in dropped]
        if not train_rows:
            raise SystemExit(f"--dataset {cfg.dataset}: every training problem is a held-out problem of {eval_spec} "
                             "in other words: train and evaluate on different problems")
        skipped["twin_of_held_out"] += len(dropped)
    return train_rows, eval_rows, skipped
