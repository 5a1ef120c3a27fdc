"""synthetic:rules, the hidden-rule task: families whose rule no problem states, held-out problems that are
new members of training families, and the guards (no twins, no shared answers, retrieval no oracle);
synthetic:rules-menu, the same as multiple choice (every rule's value listed after the question), and
synthetic:rules-choice, multiple choice among rules (four candidate rules listed, each with its own value)."""

import re

import pytest

import config
import data
import pool as pool_lib
import prompts

# the rules written out again here, apart from the generator, to check its answers against
FORMULAS = {"a + b + 10": lambda a, b: a + b + 10, "a * b - 1": lambda a, b: a * b - 1,
            "2 * a + b": lambda a, b: 2 * a + b, "a * b + a": lambda a, b: a * b + a,
            "a + 3 * b": lambda a, b: a + 3 * b, "a * a + b": lambda a, b: a * a + b,
            "10 * a + b": lambda a, b: 10 * a + b, "a + b + a * b": lambda a, b: a + b + a * b}


def read_back(text: str) -> tuple[str, int, int]:
    """(family, a, b) from a problem's wording, independently of the generator."""
    m = re.fullmatch(r"(?:What is|Compute|Find) the ((?:grand )?[a-z]+) of (\d+) and (\d+)[.?]", text)
    assert m, text
    return m.group(1), int(m.group(2)), int(m.group(3))


def read_choice(text: str) -> tuple[str, list[str], int, int]:
    """(the question, the rules listed after it in order, a and b as the request restates them)."""
    m = re.fullmatch(r"(.+[.?]) The (?:grand )?[a-z]+ of a and b is given by one of these rules: ([ab\d+*\-, ]+)\. "
                     r"Apply the right one to a = (\d+), b = (\d+) and give the number\.", text)
    assert m, text
    return m.group(1), m.group(2).split(", "), int(m.group(3)), int(m.group(4))


def read_menu(text: str) -> tuple[str, list[int]]:
    """(the question, the options listed after it, in order)."""
    m = re.fullmatch(r"(.+[.?]) It is one of: ([\d, ]+)\.", text)
    assert m, text
    return m.group(1), [int(n) for n in m.group(2).split(", ")]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rules_answers_follow_the_familys_rule_and_no_text_states_it(seed):
    rules = data.rule_families(seed)
    assert sorted(rules) == sorted(data.RULE_FAMILIES) and sorted(rules.values()) == sorted(FORMULAS)
    rows = data.synthetic_rules("train", 48, seed, [1, 2], 48) + data.synthetic_rules("test", 96, seed, [1, 2], 48)
    for r in rows:
        family, a, b = read_back(r["problem"])
        assert r["family"] == family and r["answer"] == str(FORMULAS[rules[family]](a, b)), r
        assert r["content"] == f"{family} {a} {b}"  # what twin detection and the probe's families read
        assert not re.search(r"[+*=]", r["problem"])  # the rule is never in the text
        # the worked solution applies the family's rule to the operands (what a solved member shows)
        worked = rules[family].replace("a", str(a)).replace("b", str(b))
        assert r["solution"] == (f"The {family} of {a} and {b} is {worked} = {r['answer']}. "
                                 f"The answer is \\boxed{{{r['answer']}}}.")
        assert str(eval(worked)) == r["answer"]  # noqa: S307 - our own digits and + *
    # every family is trained on and held out: held-out problems are new members of training families
    assert {r["family"] for r in rows[:48]} == {r["family"] for r in rows[48:]} == set(data.RULE_FAMILIES)
    # the assignment of rules to names is the seed's: seeds differ, splits of one seed agree
    assert rules != data.rule_families(seed + 1)


@pytest.mark.parametrize("seed", [0, 3])
def test_rules_have_no_twins_and_no_shown_answers(seed):
    """No family repeats its operands or an answer within a split (so a commutative rule never shows b, a
    beside a, b), no held-out answer is a
    training answer of any family, none is the worked example's answer, and families are drawn evenly: no
    retrieved training solution and no prompt's worked example shows a held-out problem's answer."""
    train = data.synthetic_rules("train", 48, seed, [1, 2], 48)
    test = data.synthetic_rules("test", 96, seed, [1, 2], 48)
    for split in (train, test):
        by_family = {}
        for r in split:
            family, a, b = read_back(r["problem"])
            by_family.setdefault(family, []).append(((a, b), r["answer"]))
        assert sorted(len(v) for v in by_family.values()) == [len(split) // 8] * 8
        for pairs in by_family.values():
            assert len({ops for ops, _ in pairs}) == len({ans for _, ans in pairs}) == len(pairs)
    assert not {r["answer"] for r in train} & {r["answer"] for r in test}
    shown = re.findall(r"\\boxed\{(\d+)\}", prompts.ONE_SHOT[1]["content"])
    assert shown == [data.ONE_SHOT_ANSWER] and data.ONE_SHOT_ANSWER not in {r["answer"] for r in train + test}
    # and through lanpo's own loader: the held-out rows are the test split of the training rows' seed
    cfg = config.parse_config(["--dataset", "synthetic:rules", "--levels", "1-2", "--synthetic-size", "48",
                               "--eval-size", "96", "--seed", str(seed)])
    assert data.load_rows(cfg)[:2] == (train, test)


def test_rules_levels_and_capacity_are_checked():
    assert {r["level"] for r in data.synthetic_rules("train", 60, 0, [1, 2, 3], 60)} == {1, 2, 3}
    with pytest.raises(SystemExit, match="synthetic:rules has levels 1-3, got 4"):
        data.synthetic_rules("train", 10, 0, [4], 10)
    with pytest.raises(SystemExit, match=r"^synthetic:rules cannot make 121 distinct train problems at levels \[1\]: "
                                         r"family '\w+' has no unused answer left; ask for fewer, or add harder "
                                         r"levels$"):
        data.synthetic_rules("train", 121, 0, [1], 121)  # a family's distinct level-1 answers run out
    with pytest.raises(SystemExit, match="cannot make 26 distinct test problems unseen in training"):
        data.synthetic_rules("test", 26, 0, [1], 48)
    with pytest.raises(SystemExit, match="built-in generators are synthetic:arith, synthetic:rules"):
        data.load_problems("synthetic:rule", "train", size=4)


def test_rules_retrieval_is_no_oracle():
    """TF-IDF over the problem texts returns other families beside a problem's own (zorp / grand zorp share
    a word), so the relevance judge has a real decision: measured here on a seed's training problems."""
    train = data.synthetic_rules("train", 48, 0, [1, 2], 48)
    index = pool_lib.TfidfIndex()
    for r in train:
        index.add(r["id"], r["problem"])
    family = {r["id"]: r["family"] for r in train}
    same = other = 0
    for r in train:
        for doc_id, _ in index.query(r["problem"], 3, exclude={r["id"]}):
            same += family[doc_id] == r["family"]
            other += family[doc_id] != r["family"]
    assert same > 0 and other > 0 and 0.2 < same / (same + other) < 0.9, (same, other)


@pytest.mark.parametrize("seed", [0, 2])
def test_rules_menu_lists_every_rules_value_in_an_order_that_says_nothing(seed):
    """synthetic:rules-menu: each question is followed by the distinct values of all eight rules at its
    operands, each once, so the text names the candidates but not the family's rule; where the answer stands
    in the list is spread over the places (a guess by position is right about one time in seven); answers
    follow the rule; no answer is shared between the splits or is the worked example's."""
    rules = data.rule_families(seed)
    train = data.synthetic_rules("train", 48, seed, [1, 2], 48, menu="values")
    test = data.synthetic_rules("test", 96, seed, [1, 2], 48, menu="values")
    places = []
    for r in train + test:
        question, options = read_menu(r["problem"])
        family, a, b = read_back(question)
        assert family == r["family"] and r["answer"] == str(FORMULAS[rules[family]](a, b))
        assert sorted(options) == sorted({f(a, b) for f in FORMULAS.values()}) and not re.search(r"[+*=]", question)
        places.append(options.index(int(r["answer"])))
    assert set(places) == set(range(8)) and max(places.count(k) for k in range(8)) < len(places) / 4
    assert not {r["answer"] for r in train} & {r["answer"] for r in test}
    assert data.ONE_SHOT_ANSWER not in {r["answer"] for r in train + test}
    assert {r["family"] for r in train} == {r["family"] for r in test} == set(data.RULE_FAMILIES)
    # the same problems as synthetic:rules, with the options added; lanpo's loader reads the variant by name
    plain = data.synthetic_rules("train", 48, seed, [1, 2], 48)
    assert [read_menu(r["problem"])[0] for r in train] == [r["problem"] for r in plain]
    assert [{k: v for k, v in r.items() if k != "problem"} for r in train] == [
        {k: v for k, v in r.items() if k != "problem"} for r in plain]
    cfg = config.parse_config(["--dataset", "synthetic:rules-menu", "--levels", "1-2", "--synthetic-size", "48",
                               "--eval-size", "96", "--seed", str(seed)])
    assert data.load_rows(cfg)[:2] == (train, test)


@pytest.mark.parametrize("seed", [0, 2])
def test_rules_choice_lists_the_familys_rule_among_others_whose_values_tell_them_apart(seed):
    """synthetic:rules-choice: each question lists RULE_CHOICES candidate rules, the same set for every member of
    a family, the family's among them, in an order spread over the places; at the problem's operands the
    candidates' values are distinct, so a right answer names the rule it applied (what makes the model's own
    successes carry the rule); answers follow the rule; no held-out answer is a training answer or the worked
    example's; the loader reads the variant by name."""
    rules = data.rule_families(seed)
    train = data.synthetic_rules("train", 48, seed, [1, 2], 48, menu="rules")
    test = data.synthetic_rules("test", 96, seed, [1, 2], 48, menu="rules")
    listed_by_family, places = {}, []
    for r in train + test:
        question, listed, a2, b2 = read_choice(r["problem"])
        family, a, b = read_back(question)
        assert family == r["family"] and (a2, b2) == (a, b) and r["answer"] == str(FORMULAS[rules[family]](a, b))
        assert len(listed) == len(set(listed)) == data.RULE_CHOICES and set(listed) <= set(FORMULAS)
        assert len({FORMULAS[f](a, b) for f in listed}) == data.RULE_CHOICES  # each value names one rule
        listed_by_family.setdefault(family, set()).add(frozenset(listed))
        places.append(listed.index(rules[family]))
    assert all(len(sets) == 1 and rules[f] in next(iter(sets)) for f, sets in listed_by_family.items())
    assert sorted(listed_by_family) == sorted(data.RULE_FAMILIES)
    # the family's rule is not the one every menu shares, nor given away by its place
    assert len(set.intersection(*(set(next(iter(v))) for v in listed_by_family.values()))) == 0
    assert set(places) == set(range(data.RULE_CHOICES))
    assert max(map(places.count, range(data.RULE_CHOICES))) < len(places) / 2
    assert not {r["answer"] for r in train} & {r["answer"] for r in test}
    assert data.ONE_SHOT_ANSWER not in {r["answer"] for r in train + test}
    cfg = config.parse_config(["--dataset", "synthetic:rules-choice", "--levels", "1-2", "--synthetic-size", "48",
                               "--eval-size", "96", "--seed", str(seed)])
    assert data.load_rows(cfg)[:2] == (train, test)
    with pytest.raises(ValueError, match="menu must be '', 'values' or 'rules', got 'rule'"):
        data.synthetic_rules("train", 4, seed, [1], 4, menu="rule")
