"""Problems to train and evaluate on: a built-in procedural generator (`synthetic:arith`, the embedded
default) and any hub dataset or local .jsonl/.json/.parquet file through `datasets`.

Every loader returns a list of dicts with string fields `id`, `problem`, `answer` (and `level` for the
generator). Rows are validated on load; a bad row is an error that names the file and the row.
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Ken", "Zoe"]
ARITH_LEVELS = 6
THINGS = ["apples", "pencils", "stickers", "marbles", "books", "coins", "cards", "shells"]


def _arith_problem(rng: random.Random, level: int) -> tuple[str, int]:
    """One arithmetic problem of the given difficulty level (1 = easiest; level L needs L-ish steps or digits).
    Pass rates of SmolLM2-135M-Instruct at T=1 with the one-shot prompt are in the README."""
    r = rng.randint
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    if level == 1:  # one single-digit operation
        a, b = r(1, 9), r(1, 9)
        op, value = rng.choice([("+", a + b), ("*", a * b)])
        return rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}."]), value
    if level == 2:  # carry into the tens
        a, b = r(10, 49), r(1, 9)
        return rng.choice([f"What is {a} + {b}?", f"{name} has {a} {thing} and gets {b} more. "
                                                  f"How many {thing} does {name} have now?"]), a + b
    if level == 3:  # two two-digit numbers
        a, b = r(10, 99), r(10, 99)
        if rng.random() < 0.5:
            return f"What is {a} + {b}?", a + b
        a, b = max(a, b), min(a, b)
        return f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b
    if level == 4:  # three terms
        a, b, c = r(2, 30), r(2, 30), r(2, 30)
        return f"{name} has {a} {thing}, buys {b} more, then finds {c} more. How many {thing} now?", a + b + c
    if level == 5:  # multiply then add
        a, b, c = r(2, 9), r(2, 9), r(1, 20)
        return f"{name} buys {a} bags with {b} {thing} in each, then gets {c} more. How many {thing}?", a * b + c
    if level == 6:  # multiply then subtract, two-digit factors
        a, b, c = r(2, 12), r(2, 12), r(2, 9)
        c = min(c, a * b - 1)
        return (f"{name} has {a} boxes of {b} {thing} and gives away {c} {thing}. "
                f"How many {thing} are left?"), a * b - c
    raise ValueError(f"synthetic:arith has levels 1-{ARITH_LEVELS}, got {level}")



def synthetic_arith(split: str, size: int, seed: int, levels: list[int], train_size: int = 2000) -> list[dict]:
    """`size` problems with levels drawn uniformly from `levels`, deterministic in (split, seed).
    Any other split never repeats a problem text of the `train_size` train problems of the same seed."""
    for level in levels:
        if not 1 <= level <= ARITH_LEVELS:
            raise SystemExit(f"--levels: synthetic:arith has levels 1-{ARITH_LEVELS}, got {level}")
    train_texts: set[str] = set()
    if split != "train":
        train_texts = {row["problem"] for row in synthetic_arith("train", train_size, seed, levels)}
    rng = random.Random(f"arith-{split}-{seed}")
    rows, seen = [], set(train_texts)
    while len(rows) < size:
        level = rng.choice(levels)  # drawn first, so held-out splits keep the level mix of the train split
        for _ in range(1000):
            problem, answer = _arith_problem(rng, level)
            if split == "train" or problem not in seen:  # held out means unseen
                break
        else:
            raise SystemExit(f"synthetic:arith cannot make {size} unseen {split} problems at level {level}: "
                             f"ask for fewer, or add harder levels (more distinct problems)")
        seen.add(problem)
        rows.append({"id": f"arith-{split}-{len(rows):05d}", "problem": problem, "answer": str(answer),
                     "level": level})
    return rows


def load_problems(spec: str, split: str, *, size: int = 0, seed: int = 0, levels: list[int] | None = None,
                  train_size: int = 2000, id_field: str = "id", problem_field: str = "problem", answer_field: str = "answer") -> list[dict]:
    """Problems from `spec`: 'synthetic:arith', a local file, or a hub dataset name (split = its split).
    size > 0 keeps the first `size` rows (files) or generates that many (synthetic; held-out splits avoid
    the first `train_size` train problems)."""
    if spec.startswith("synthetic:"):
        if spec != "synthetic:arith":
            raise SystemExit(f"--dataset {spec}: the built-in generator is 'synthetic:arith'")
        return synthetic_arith(split, size or train_size, seed, levels or list(range(1, ARITH_LEVELS + 1)), train_size)
    from datasets import load_dataset

    path = Path(spec)
    if path.suffix in (".jsonl", ".json", ".parquet"):
        if not path.is_file():
            raise SystemExit(f"{spec}: file not found")
        if path.stat().st_size == 0:
            raise SystemExit(f"{spec}: the file is empty")
        builder = "parquet" if path.suffix == ".parquet" else "json"
        try:
            table = load_dataset(builder, data_files=str(path), split="train")
        except Exception as e:  # noqa: BLE001 - any parse failure of a user file becomes one clear message
            raise SystemExit(f"{spec}: cannot be read as {builder}: {type(e).__name__}: {e}") from None
    else:
        table = load_dataset(spec, split=split)
    rows = validate_rows(table, spec, id_field, problem_field, answer_field)
    return rows[:size] if size else rows


def validate_rows(table, source: str, id_field: str, problem_field: str, answer_field: str) -> list[dict]:
    """Rows as {id, problem, answer} strings; SystemExit naming source and row for anything unusable."""
    columns = set(table.column_names)
    for flag, name in (("--problem-field", problem_field), ("--answer-field", answer_field)):
        if name not in columns:
            raise SystemExit(f"{source}: no column {name!r} ({flag}); columns are {sorted(columns)}")
    rows, seen_ids = [], set()
    for index, row in enumerate(table):
        problem, answer = row[problem_field], row[answer_field]
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        for name, value in ((problem_field, problem), (answer_field, answer)):
            if not isinstance(value, str) or not value.strip():
                raise SystemExit(f"{source}: row {index} has an empty or non-string {name!r}: {value!r}")
        row_id = str(row[id_field]) if id_field in columns and row[id_field] is not None else f"row-{index:06d}"
        if row_id in seen_ids:
            raise SystemExit(f"{source}: row {index} repeats id {row_id!r}")
        seen_ids.add(row_id)
        rows.append({"id": row_id, "problem": problem.strip(), "answer": answer.strip()})
    if not rows:
        raise SystemExit(f"{source}: no rows")
    return rows
