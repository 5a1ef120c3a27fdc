"""data.py: the built-in generator and file loading with row-level errors."""

import json
import math
import re

import pytest
from conftest import ROOT

import data


def test_synthetic_is_deterministic_and_answers_are_right():
    a = data.synthetic_arith("train", 300, seed=3, levels=[1, 2, 3, 4, 5, 6])
    assert a == data.synthetic_arith("train", 300, seed=3, levels=[1, 2, 3, 4, 5, 6])
    assert a != data.synthetic_arith("train", 300, seed=4, levels=[1, 2, 3, 4, 5, 6])
    assert {r["level"] for r in a} == {1, 2, 3, 4, 5, 6}
    for r in a:
        if r["problem"].startswith(("What is", "Compute")):  # pure expressions: check with Python arithmetic
            expr = r["problem"].removeprefix("What is").removeprefix("Compute").strip(" ?.")
            assert str(eval(expr)) == r["answer"], r  # noqa: S307 - our own generated digits and + - *


def arithmetic(text: str) -> tuple:
    """The arithmetic of a synthetic problem read back from its wording, independently of the generator:
    operands of + and * unordered."""
    a, *rest = nums = [int(n) for n in re.findall(r"\d+", text)]
    if "bags" in text:
        return ("*+", tuple(sorted(nums[:2])), nums[2])
    if "boxes" in text:
        return ("*-", tuple(sorted(nums[:2])), nums[2])
    if "gives away" in text:
        return ("-", a, rest[0])
    return ("*" if "*" in text else "+", tuple(sorted(nums)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_synthetic_splits_are_distinct_by_content_not_just_text(seed):
    """bench/learning.py's splits (48 train, 256 held out, levels 1-3): no two train problems and no train and
    held-out problem share their arithmetic in any wording ("What is 23 + 5?" = "Tom has 23 apples and gets
    5 more ..." = "Compute 5 + 23."), and the held-out problems are distinct too."""
    train = data.synthetic_arith("train", 48, seed=seed, levels=[1, 2, 3])
    test = data.synthetic_arith("test", 256, seed=seed, levels=[1, 2, 3], train_size=48)
    train_content = [arithmetic(r["problem"]) for r in train]
    test_content = [arithmetic(r["problem"]) for r in test]
    assert len(set(train_content)) == 48 and len(set(test_content)) == 256
    assert not set(train_content) & set(test_content)
    assert len(test) == 256 and {r["level"] for r in test} == {1, 2, 3}


def test_synthetic_levels_that_run_out_are_no_longer_drawn():
    # level 1: 45 sums and 45 products of 1-9, less 2 * 2 (2 + 2's operands and answer) and 2 + 5 (the worked
    # example every prompt shows): 88 distinct problems
    big = data.synthetic_arith("train", 400, seed=0, levels=[1, 2])
    assert sum(r["level"] == 1 for r in big) == 88 and len({arithmetic(r["problem"]) for r in big}) == 400
    with pytest.raises(SystemExit, match=r"^synthetic:arith cannot make 10 distinct test problems unseen in training "
                                         r"at levels \[1\]: ask for fewer, or add harder levels \(more distinct "
                                         r"problems\)$"):
        data.synthetic_arith("test", 10, seed=0, levels=[1], train_size=88)  # every level-1 problem trained on
    with pytest.raises(SystemExit, match=r"^synthetic:arith cannot make 89 distinct train problems at levels \[1\]: "):
        data.synthetic_arith("train", 89, seed=0, levels=[1])
    with pytest.raises(SystemExit, match="levels 1-6"):
        data.synthetic_arith("train", 10, seed=0, levels=[7])


def test_local_jsonl_loads_and_bad_rows_are_named(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"id": f"p{i}", "q": f"What is {i}+1?", "a": i + 1}) + "\n" for i in range(5)))
    rows, _ = data.load_problems(str(good), "train", problem_field="q", answer_field="a")
    assert rows[2] == {"id": "p2", "problem": "What is 2+1?", "answer": "3"}
    with pytest.raises(SystemExit, match="no column 'problem'"):
        data.load_problems(str(good), "train")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "ok", "answer": "1"}) + "\n"
                   + json.dumps({"problem": " ", "answer": "2"}) + "\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl: line 2 has an empty"):
        data.load_problems(str(bad), "train")
    dup = tmp_path / "dup.jsonl"
    dup.write_text("".join(json.dumps({"id": "same", "problem": "p", "answer": "1"}) + "\n" for _ in range(2)))
    with pytest.raises(SystemExit, match="line 2 repeats id 'same'"):
        data.load_problems(str(dup), "train")
    with pytest.raises(SystemExit, match="file not found"):
        data.load_problems(str(tmp_path / "missing.jsonl"), "train")


# name -> (rows, sha256 of the JSON Lines, decompressed), as data/README.md lists them
SHIPPED = {
    "math500": (500, "cbc8b3342ad0e0b8de80e2baaaed8d4be3a962d75093abf6b700cce50e77c28c"),
    "aime24": (30, "fac1ff3012305a242b49ff7670ecb9978b0e19c4465dd72e98b03e3ff96b6475"),
    "aime25": (30, "64afb65c01b9c0a85c0b49057ba4782a2d7703a86b2bde5f2940c7b947c9e81f"),
    "amc23": (40, "e2fe94c7f08c2bef49b3e8199b06e34004543f6f11ff4b610b668349e66cfe38"),
    "gsm8k": (1319, "934ffc38527820a4ab8eed09cae1444193554cd8eed394b44c6cdd2e73d97096"),
    "gsm8k_train": (7473, "32ccaa7555cdf1eed8f03301cbe75c00d3c9b7b993eee149bf73ad2d352853a5"),
    "math_train": (7500, "5befe15afbf2196c4eec19bed83b2b146e906f9ddc085933617dbea6f79d6366"),
    "math": (5000, "7f845b91fbfd80ccd0e1f0972ec7e1dae7b5eed57179616c3c4b4b9d7d2f1672"),
}


@pytest.mark.parametrize("name", SHIPPED)
def test_every_benchmark_ships_in_the_repository_unchanged(name):
    """Each benchmark name resolves to a file of data/, with the row count and checksum its README gives."""
    import gzip
    import hashlib

    path = data.benchmark_path(name, data.DATA_DIR)
    assert path.parent == ROOT / "data"
    raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    assert (len(raw.splitlines()), hashlib.sha256(raw).hexdigest()) == SHIPPED[name]
    assert path.name in (ROOT / "data" / "README.md").read_text()
    rows, skipped = data.load_problems(name, "test", skip_bad=True)
    assert len(rows) + sum(skipped.values()) == SHIPPED[name][0]
    assert skipped == ({"duplicate_problem": 2} if name == "math_train" else {})  # one in whitespace, one in layout
    if name == "math500":
        assert rows[0]["id"] == "math500-0001" and rows[2]["answer"] == "\\frac{14}{3}"


def test_a_benchmark_name_reads_another_folder_with_data_dir(tmp_path):
    (tmp_path / "aime24.jsonl").write_text(json.dumps({"id": "m", "problem": "Mirror?", "answer": "1"}) + "\n")
    assert data.load_problems("aime24", "test", data_dir=tmp_path)[0] == [{"id": "m", "problem": "Mirror?",
                                                                            "answer": "1"}]
    with pytest.raises(SystemExit, match=f"benchmark amc23: amc23.jsonl not found in --data-dir {tmp_path}; give "
                                         "a file path instead"):
        data.load_problems("amc23", "test", data_dir=tmp_path)


def test_a_mistyped_name_is_named_and_a_byte_order_mark_is_no_column(tmp_path, monkeypatch):
    import hub

    monkeypatch.setattr(hub, "require", lambda *a: pytest.fail("a typo must not reach the hub"))
    with pytest.raises(SystemExit, match=r"math501: no such benchmark; did you mean math500\?"):
        data.load_problems("math501", "train")
    for suffix, text in ((".jsonl", '{"problem": "P?", "answer": "1"}\n'), (".csv", "problem,answer\nP?,1\n"),
                         (".json", '[{"problem": "P?", "answer": 1}]')):
        path = tmp_path / f"bom{suffix}"
        path.write_text("\ufeff" + text, encoding="utf-8")
        assert data.load_problems(str(path), "train")[0] == [{"id": "row-000000", "problem": "P?", "answer": "1"}]


def test_nothing_a_user_runs_or_reads_names_the_development_machines_data_folder():
    """A clone has no ../shared: README, recipes, scripts, configs and docs use benchmark names."""
    user_facing = [ROOT / "README.md", ROOT / "run.sh", ROOT / "data" / "README.md", *ROOT.glob("*.py"),
                   *(ROOT / "bench").glob("*.py"), *(ROOT / "configs").glob("*"), *(ROOT / "docs").glob("*.md")]
    named = [p.name for p in user_facing if re.search(r"\.\./shared|shared/data", p.read_text(encoding="utf-8"))]
    assert named == []


def test_every_kind_of_bad_row_is_named_or_skipped_and_counted(tmp_path):
    lines = [json.dumps({"id": "a", "problem": "What is 1+1?", "answer": "2"}),
             json.dumps({"id": "b", "problem": 17, "answer": "3"}),                    # non-string problem
             json.dumps({"id": "c", "problem": "What is 2+2?"}),                       # missing answer
             json.dumps({"id": "a", "problem": "What is 3+3?", "answer": "6"}),        # repeated id
             json.dumps({"id": "e", "problem": "What is  1+1? ", "answer": "2"}),      # repeated problem (whitespace)
             json.dumps({"id": "f", "problem": "What is 4+4?", "answer": 8})]          # numeric answer: fine
    path = tmp_path / "messy.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit, match=r"messy.jsonl: line 2 has an empty, missing or non-string 'problem': 17"):
        data.load_problems(str(path), "train")
    rows, skipped = data.load_problems(str(path), "train", skip_bad=True)
    assert [r["id"] for r in rows] == ["a", "f"] and rows[1]["answer"] == "8"
    assert skipped == {"empty_or_non_string": 2, "duplicate_id": 1, "duplicate_problem": 1}
    path.write_text(lines[0] + "\n" + lines[4] + "\n")
    with pytest.raises(SystemExit, match=r"line 2 repeats the problem of id 'a'"):
        data.load_problems(str(path), "train")
    latex = [json.dumps({"id": "x", "problem": "Find $x$ if $2x + 1 = 5$.", "answer": "2"}),
             json.dumps({"id": "y", "problem": "Find $x$ if $2x\\,+\\;1=5$.", "answer": "2"}),  # LaTeX spacing
             json.dumps({"id": "z", "problem": "Find $x$ if $2x + 1 = 7$.", "answer": "3"})]
    path.write_text("\n".join(latex) + "\n")
    with pytest.raises(SystemExit, match=r"line 2 repeats the problem of id 'x' \(the same text up to whitespace "
                                         r"and LaTeX spacing\)"):
        data.load_problems(str(path), "train")
    assert [r["id"] for r in data.load_problems(str(path), "train", skip_bad=True)[0]] == ["x", "z"]


def test_broken_files_are_named(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"problem": "p", "answer": "1"}\n{"problem": "q", "answer": \n')
    with pytest.raises(SystemExit, match=r"broken.jsonl: line 2 is not valid JSON"):
        data.load_problems(str(path), "train")
    path.write_bytes(b'{"problem": "p", "answer": "1"}\n{"problem": "\xff\xfe", "answer": "1"}\n')
    with pytest.raises(SystemExit, match=r"broken.jsonl: line 2 is not valid UTF-8"):
        data.load_problems(str(path), "train")
    path.write_text('[1, 2]\n')
    with pytest.raises(SystemExit, match=r"line 1 is not a JSON object"):
        data.load_problems(str(path), "train")
    everything_bad = tmp_path / "allbad.jsonl"
    everything_bad.write_text(json.dumps({"problem": "", "answer": ""}) + "\n")
    with pytest.raises(SystemExit, match="no usable rows"):
        data.load_problems(str(everything_bad), "train", skip_bad=True)


def test_content_key_is_operands_and_answer():
    def row(content, answer):
        return {"problem": "p", "answer": answer, "content": content}
    assert data.content_key(row("+ 2 2", "4")) == data.content_key(row("* 2 2", "4")) == "2 2 = 4"
    assert data.content_key(row("+ 5 23", "28")) == "5 23 = 28" != data.content_key(row("* 5 23", "115"))
    assert data.content_key(row("* 2 2 + 3", "7")) == data.content_key(row("+ 3 2 2", "7")) == "2 2 3 = 7"
    assert data.content_key({"problem": "p", "answer": "1"}) == ""  # a data file's row: its text is its key
    assert data.ONE_SHOT_KEY == "2 5 = 7"


@pytest.mark.parametrize("seed", range(6))
def test_no_generated_problem_is_the_worked_example_or_another_in_other_words(seed):
    """Every prompt shows "What is 2 + 5? ... \\boxed{7}": no split of any level mix holds 2 + 5 or 5 + 2 in
    any wording; no two problems of a split, and no held-out and training problem, share operands and answer."""
    for levels in ([1], [1, 2, 3], [1, 2, 3, 4, 5, 6]):
        train = data.synthetic_arith("train", 48 if levels != [1] else 88, seed=seed, levels=levels)
        test = data.synthetic_arith("test", 64 if levels != [1] else 0, seed=seed, levels=levels,
                                    train_size=len(train))
        for split in (train, test):
            keys = [data.content_key(r) for r in split]
            assert len(set(keys)) == len(keys) and data.ONE_SHOT_KEY not in keys
            assert ("+", (2, 5)) not in {arithmetic(r["problem"]) for r in split}
        assert not {data.content_key(r) for r in train} & {data.content_key(r) for r in test}


REWORDED = "If $x$, $y$, and $z$ are positive with $xy={}$, $xz = 48$, and $yz=72$, what is the value of $x+y+z$?"


def test_held_out_twins_by_text_by_content_and_reworded():
    train = [{"id": "t1", "problem": "Find $x+y$ if $xy=24$.", "answer": "10"},           # layout only
             {"id": "t2", "problem": "What is 2 + 2?", "answer": "4", "content": "+ 2 2"},  # same operands, answer
             {"id": "t3", "problem": REWORDED.format(24), "answer": "22"},  # reworded (math_train-0390)
             {"id": "t4", "problem": REWORDED.format(25), "answer": "22"},  # other numbers
             {"id": "t5", "problem": REWORDED.format(24), "answer": "23"}]  # other answer
    held = [{"id": "e1", "problem": "find x + y if xy = 24", "answer": "10"},
            {"id": "e2", "problem": "Compute 2 * 2.", "answer": "4", "content": "* 2 2"},
            {"id": "e3", "problem": "If $x$, $y$, and $z$ are positive with $xy = 24$, $xz = 48$, and $yz = 72$, "
                                    "then find $x + y + z.$", "answer": "22"}]  # math500-0238
    assert data.held_out_twins(train, held) == [("t1", "e1", "same text"), ("t2", "e2", "same content"),
                                                ("t3", "e3", "reworded")]
    # answers compare without their spacing, on either side ("22" = "2\,2" = "2 2")
    for gold, spaced in (("22", "2\\,2"), ("2 2", "22")):
        train[2]["answer"], held[2]["answer"] = gold, spaced
        assert ("t3", "e3", "reworded") in data.held_out_twins(train, held), (gold, spaced)


def test_shipped_training_and_held_out_files_share_the_listed_twins():
    """data/README.md lists these: MATH-500 holds 5 problems of math_train in other words, the MATH test split 27."""
    train = data.load_problems("math_train", "train", skip_bad=True)[0]
    found = {name: data.held_out_twins(train, data.load_problems(name, "test")[0])
             for name in ("math500", "math", "aime24", "aime25", "amc23")}
    assert [len(found[name]) for name in found] == [5, 27, 0, 0, 0]
    assert ("math_train-0390", "math500-0238", "reworded") in found["math500"]
    assert ("math_train-0307", "math_test-0261", "same text") in found["math"]
    gsm = data.held_out_twins(data.load_problems("gsm8k_train", "train")[0], data.load_problems("gsm8k", "test")[0])
    assert gsm == []


def test_training_drops_or_refuses_problems_that_are_held_out_ones(tmp_path):
    import config
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "t1", "problem": "Find $x$ if $2x = 10$.", "answer": "5"},
        {"id": "t2", "problem": "What is 3 + 4?", "answer": "7"},
        {"id": "t3", "problem": "Find $x$ if $3x = 12$.", "answer": "4"}]))
    held.write_text(json.dumps({"id": "e1", "problem": "find x if 2x = 10", "answer": "5"}) + "\n")
    cfg = config.Config(dataset=str(train), eval_dataset=str(held))
    rows, _, skipped = data.load_rows(cfg)
    assert [r["id"] for r in rows] == ["t2", "t3"] and skipped["twin_of_held_out"] == 1
    with pytest.raises(SystemExit, match=r"1 training problems are held-out problems .* t1 = e1 \(same text\)"):
        data.load_rows(config.Config(dataset=str(train), eval_dataset=str(held), eval_overlap="refuse"))
    with pytest.raises(SystemExit, match="every training problem is a held-out problem"):
        data.load_rows(config.Config(dataset=str(held), eval_dataset=str(held)))
    # the README's MATH recipe: 5 of MATH-500's problems are in math_train in other words
    _, _, skipped = data.load_rows(config.Config(dataset="math_train", skip_bad_rows=True, eval_dataset="math500",
                                                 eval_size=0))
    assert skipped == {"duplicate_problem": 2, "twin_of_held_out": 5}


@pytest.mark.parametrize("name, content, message", [
    ("rows.txt", b"problem,answer\n", r"rows.txt: unsupported file type \.txt: use \.jsonl, \.jsonl\.gz, \.json, "
                                      r"\.parquet, \.csv$"),
    ("rows", b"x", r"rows: unsupported file type \(none\): use \.jsonl, "),
    ("empty.jsonl", b"", r"empty.jsonl: the file is empty$"),
    ("latin.csv", "problem,answer\nCaf\u00e9,1\n".encode("latin-1"), r"latin.csv: not a readable UTF-8 CSV file \("),
    ("cut.jsonl.gz", b"\x1f\x8b\x08\x00 not gzip", r"cut.jsonl.gz: not a readable gzip file \("),
    ("bad.json", b'[{"problem": "p"', r"bad.json: not valid UTF-8 JSON \("),
    ("scalars.json", b"[1, 2]", r"scalars.json: expected a JSON list of objects$"),
    ("object.json", b'{"problem": "p", "answer": "1"}', r"object.json: expected a JSON list of objects$"),
    ("bad.parquet", b"PAR1 not parquet", r"bad.parquet: cannot be loaded: ArrowInvalid: Parquet magic bytes not found"),
])
def test_every_unreadable_file_stops_with_one_line_that_names_it(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(SystemExit, match=re.escape(str(tmp_path)) + "/" + message):
        data.load_problems(str(path), "train")


def test_blank_lines_quoted_line_breaks_and_parquet_files_are_read_whole(tmp_path):
    """A blank line inside a .jsonl file is skipped, not its end; a CSV field keeps the line break inside its
    quotes as written ("\\r\\n"); a parquet file reads every row through `datasets`, named by row."""
    path = tmp_path / "gaps.jsonl"
    path.write_text('{"id": "a", "problem": "P?", "answer": "1"}\n\n   \n{"id": "b", "problem": "Q?", "answer": "2"}\n')
    assert [r["id"] for r in data.load_problems(str(path), "train")[0]] == ["a", "b"]
    path = tmp_path / "breaks.csv"
    path.write_bytes(b'id,problem,answer\r\nc,"Line one\r\nline two?",3\r\n')
    assert data.load_problems(str(path), "train")[0] == [{"id": "c", "problem": "Line one\r\nline two?", "answer": "3"}]
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": ["d", "e"], "problem": ["R?", "S?"], "answer": ["4", "5"]}), path)
    assert data.read_records(str(path), "test") == [("row 0", {"id": "d", "problem": "R?", "answer": "4"}),
                                                    ("row 1", {"id": "e", "problem": "S?", "answer": "5"})]


@pytest.fixture
def fake_hub(monkeypatch):
    """The hub replaced: every check (hub.require) and load (datasets.load_dataset) recorded, each load one row."""
    import datasets

    import hub

    asked = []
    monkeypatch.setattr(hub, "require", lambda *a: asked.append(("require", *a)))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: asked.append(("load", a, k)) or
                        [{"id": "h", "problem": "H?", "answer": "6"}])
    return asked


def test_a_hub_data_set_is_checked_then_loaded_by_its_id_and_split(fake_hub, monkeypatch):
    """owner/name and hub:<id> reach the hub as that id, with the asked split; a failing load is one line."""
    import datasets

    asked = fake_hub
    assert data.load_problems("someone/problems", "validation")[0] == [{"id": "h", "problem": "H?", "answer": "6"}]
    assert data.load_problems("hub:math500", "test")[0] == [{"id": "h", "problem": "H?", "answer": "6"}]
    assert asked == [("require", "someone/problems", "dataset", "--dataset", "README.md"),
                     ("load", ("someone/problems",), {"split": "validation"}),
                     ("require", "math500", "dataset", "--dataset", "README.md"),
                     ("load", ("math500",), {"split": "test"})]

    def unreachable(*a, **k):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(SystemExit, match=r"^someone/problems: cannot be loaded: ConnectionError: no route to host$"):
        data.load_problems("someone/problems", "train")


def test_a_benchmark_file_missing_from_data_is_named_with_the_folder_it_was_looked_for_in(tmp_path, monkeypatch):
    monkeypatch.setitem(data.BENCHMARKS, "gone", "gone.jsonl")
    with pytest.raises(SystemExit, match=r"^benchmark gone: gone.jsonl not found in the repository's data/; give a "
                                         r"file path instead$"):
        data.load_problems("gone", "test")
    with pytest.raises(SystemExit, match=r"^benchmark gone: gone.jsonl not found in --data-dir "):
        data.load_problems("gone", "test", data_dir=tmp_path)


def test_a_file_with_no_rows_or_without_the_asked_columns_is_named(tmp_path):
    path = tmp_path / "none.json"
    path.write_text("[]")
    with pytest.raises(SystemExit, match=r"none.json: no rows$"):
        data.load_problems(str(path), "train")
    path = tmp_path / "cols.jsonl"
    path.write_text('{"q": "P?", "a": "1"}\n')
    with pytest.raises(SystemExit, match=r"cols.jsonl: no column 'problem' \(--problem-field\); columns are \['a', "
                                         r"'q'\]$"):
        data.load_problems(str(path), "train")
    with pytest.raises(SystemExit, match=r"cols.jsonl: no column 'answer' \(--answer-field\); columns are \['a', "
                                         r"'q'\]$"):
        data.load_problems(str(path), "train", problem_field="q")


def test_size_keeps_a_files_first_rows_and_no_levels_means_every_level(tmp_path):
    path = tmp_path / "five.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "problem": f"P{i}?", "answer": str(i)}) + "\n"
                            for i in range(5)))
    assert [r["id"] for r in data.load_problems(str(path), "train", size=2)[0]] == ["r0", "r1"]
    assert len(data.load_problems(str(path), "train")[0]) == 5
    for spec, count in (("synthetic:arith", data.ARITH_LEVELS), ("synthetic:rules", data.RULES_LEVELS)):
        rows = data.load_problems(spec, "train", size=96, seed=1)[0]
        assert {r["level"] for r in rows} == set(range(1, count + 1)), spec


def test_only_a_bare_name_near_a_benchmarks_is_called_a_typo(tmp_path, monkeypatch, fake_hub):
    """"math501" is a typo of math500, named with every benchmark; a hub id with a slash ("owner/math500") and
    an existing file named like a benchmark ("math50.jsonl", read by a path without a slash) are not."""
    with pytest.raises(SystemExit, match=r"^math501: no such benchmark; did you mean math500\? \(names: "
                                         + re.escape(", ".join(data.BENCHMARKS)) + r"; a hub data set is "):
        data.load_problems("math501", "train")
    assert data.load_problems("owner/math500", "train")[0][0]["id"] == "h" and fake_hub[0][1] == "owner/math500"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "math50.jsonl").write_text('{"id": "f", "problem": "F?", "answer": "7"}\n')
    assert data.load_problems("math50.jsonl", "train")[0][0]["id"] == "f"


def worded_answer(text: str) -> tuple[int, str]:
    """A synthetic:arith problem's answer and content key, computed from its wording alone (`arithmetic`)."""
    op, *parts = arithmetic(text)
    if op in ("*+", "*-"):
        (x, y), c = parts
        return (x * y + c if op == "*+" else x * y - c), f"* {x} {y} {op[1]} {c}"
    if op == "-":
        a, b = parts
        return a - b, f"- {a} {b}"
    (nums,) = parts
    return (math.prod(nums) if op == "*" else sum(nums)), " ".join([op, *map(str, nums)])


# level -> the operand ranges its wording draws from (data._arith_problem's), written out again here
ARITH_RANGES = {1: [(1, 9), (1, 9)], 2: [(10, 49), (1, 9)], 3: [(10, 99), (10, 99)], 4: [(2, 30)] * 3,
                5: [(2, 9), (2, 9), (1, 20)], 6: [(2, 12), (2, 12), (2, 9)]}


@pytest.mark.parametrize("level", sorted(ARITH_RANGES))
def test_every_wording_of_every_level_has_the_answer_its_words_say(level):
    """Read back from the words alone, 3,000 draws of a level: the answer and content key agree with the
    wording, every operand stays in the level's range and reaches both ends of it, no answer is negative
    (level 6 gives away at most one less than the boxes hold), and each of the level's wordings occurs."""
    import random

    rng = random.Random(f"wording-{level}")
    seen = [set() for _ in ARITH_RANGES[level]]
    wordings, answers = set(), set()
    for _ in range(3000):
        text, answer, content = data._arith_problem(rng, level)
        assert (answer, content) == worded_answer(text), text
        for got, (lo, hi), values in zip(map(int, re.findall(r"\d+", text)), ARITH_RANGES[level], seen, strict=True):
            assert lo <= got <= hi, text
            values.add(got)
        answers.add(answer)
        wordings.add(text.split()[0] if text.startswith(("What", "Compute")) else "story")
    for values, (lo, hi) in zip(seen, ARITH_RANGES[level], strict=True):
        assert min(values) == lo and max(values) == hi, (level, lo, hi, min(values), max(values))
    # the smallest answers: 1 * 1, 10 + 1, n - n, and 2 boxes of 2 less 3 (never fewer left than 1)
    assert min(answers) == {1: 1, 2: 11, 3: 0, 6: 1}.get(level, min(answers)) and min(answers) >= 0
    assert wordings == {1: {"What", "Compute"}, 2: {"What", "story"}, 3: {"What", "story"}}.get(level, {"story"})
