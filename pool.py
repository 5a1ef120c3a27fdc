"""The dynamic experience pool: every trial the policy made (problem, prompt kind, the feedback it saw,
response, reward, step), with two queries that LANPO's feedback is built from:

- `attempts(problem_id, k, kind)`: the model's own earlier responses to a problem, newest first, of one kind
  or any (reflection);
- `similar(problem_text, k, exclude_id, content_key, solved)`: other problems (any, or only those with a
  trial of reward > 0), ranked by a retriever (abstraction).
  A twin of the query is never offered, under any id: a problem with its text up to layout (`data.twin_text`)
  or, for generated problems, its operands and answer (`data.content_key`: "2 + 2" twins "2 * 2"). A twin's
  solution would carry the query's answer into its prompt.

Memory is bounded: at most `max_per_problem` trials per problem (the oldest trial of that problem goes
first) and at most `max_problems` problems (the problem whose newest trial is oldest goes first, with
all its trials). The retrieval index updates incrementally as problems arrive or leave.
Saved as JSON Lines, one trial per line, oldest first: `head pool.jsonl` shows what the model saw.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from data import content_key, terms, twin_keys

KINDS = ("scratch", "reflect", "abstract")


@dataclass
class Trial:
    problem_id: str
    problem: str
    kind: str      # scratch | reflect | abstract
    context: str   # the feedback text the prompt carried ("" for scratch)
    response: str
    reward: float
    step: int
    content_key: str = ""  # data.content_key of the problem ("" for data files): its twins share it


class TfidfIndex:
    """Cosine similarity of TF-IDF vectors (smoothed idf, as scikit-learn), kept incrementally: adding or
    removing a document touches only its own terms; idf is read from live document frequencies."""

    def __init__(self) -> None:
        self.docs: dict[str, Counter] = {}
        self.df: Counter = Counter()
        self.postings: dict[str, set[str]] = {}

    def add(self, doc_id: str, text: str) -> None:
        if doc_id in self.docs:
            return
        counts = Counter(terms(text))
        self.docs[doc_id] = counts
        for term in counts:
            self.df[term] += 1
            self.postings.setdefault(term, set()).add(doc_id)

    def remove(self, doc_id: str) -> None:
        for term in self.docs.pop(doc_id, {}):
            self.df[term] -= 1
            self.postings[term].discard(doc_id)

    def _idf(self, term: str) -> float:
        return math.log((1 + len(self.docs)) / (1 + self.df.get(term, 0))) + 1.0

    def query(self, text: str, k: int, exclude: set[str]) -> list[tuple[str, float]]:
        q = Counter(terms(text))
        q_vec = {t: c * self._idf(t) for t, c in q.items()}
        q_norm = math.sqrt(sum(v * v for v in q_vec.values())) or 1.0
        candidates = sorted({d for t in q for d in self.postings.get(t, ())} - exclude)
        scored = []
        for doc_id in candidates:
            counts = self.docs[doc_id]
            weights = np.array([c * self._idf(t) for t, c in counts.items()])
            dot = sum(v * counts[t] * self._idf(t) for t, v in q_vec.items() if t in counts)
            scored.append((doc_id, dot / (q_norm * float(np.linalg.norm(weights)) or 1.0)))
        scored.sort(key=lambda x: (-x[1], x[0]))  # ties broken by id: deterministic
        return scored[:k]


class EmbeddingIndex:
    """Cosine similarity of embeddings from `embed(texts) -> [n, d] array` (e.g. mean-pooled hidden
    states of the policy). Vectors are computed once, when a problem enters the pool."""

    def __init__(self, embed: Callable[[list[str]], np.ndarray]) -> None:
        self.embed = embed
        self.vectors: dict[str, np.ndarray] = {}

    def add(self, doc_id: str, text: str) -> None:
        if doc_id not in self.vectors:
            v = np.asarray(self.embed([text])[0], dtype=np.float64)
            self.vectors[doc_id] = v / (np.linalg.norm(v) or 1.0)

    def remove(self, doc_id: str) -> None:
        self.vectors.pop(doc_id, None)

    def query(self, text: str, k: int, exclude: set[str]) -> list[tuple[str, float]]:
        ids = sorted(set(self.vectors) - exclude)
        if not ids:
            return []
        q = np.asarray(self.embed([text])[0], dtype=np.float64)
        q = q / (np.linalg.norm(q) or 1.0)
        scores = np.stack([self.vectors[i] for i in ids]) @ q
        order = sorted(range(len(ids)), key=lambda j: (-scores[j], ids[j]))
        return [(ids[j], float(scores[j])) for j in order[:k]]


class ExperiencePool:
    def __init__(self, max_per_problem: int = 8, max_problems: int = 20000, index=None) -> None:
        if max_per_problem < 1 or max_problems < 1:
            raise ValueError("pool caps must be >= 1")
        self.max_per_problem = max_per_problem
        self.max_problems = max_problems
        self.index = index if index is not None else TfidfIndex()
        # problem_id -> its trials, oldest first; dict order = least recently updated problem first
        self.trials: OrderedDict[str, list[Trial]] = OrderedDict()
        self.ids_by_key: dict[str, set[str]] = {}  # twin key -> the ids of the problems with it

    def __len__(self) -> int:
        return sum(len(t) for t in self.trials.values())

    def add(self, trials: list[Trial]) -> None:
        for trial in trials:
            if trial.kind not in KINDS:
                raise ValueError(f"trial kind must be one of {KINDS}, got {trial.kind!r}")
            bucket = self.trials.setdefault(trial.problem_id, [])
            self.trials.move_to_end(trial.problem_id)
            bucket.append(trial)
            del bucket[:-self.max_per_problem]
            self.index.add(trial.problem_id, trial.problem)
            for key in twin_keys(trial.problem, trial.content_key):
                self.ids_by_key.setdefault(key, set()).add(trial.problem_id)
        while len(self.trials) > self.max_problems:
            self.remove(next(iter(self.trials)))

    def remove(self, problem_id: str) -> None:
        """Forget a problem and all its trials."""
        trials = self.trials.pop(problem_id)
        self.index.remove(problem_id)
        for key in twin_keys(trials[0].problem, trials[0].content_key):
            self.ids_by_key[key].discard(problem_id)

    def twins_of(self, rows: list[dict]) -> list[tuple[str, str]]:
        """(pool problem id, row id) for each pool problem that is one of `rows` in other words (data.twin_keys)."""
        owner = {key: row["id"] for row in rows for key in twin_keys(row["problem"], content_key(row))}
        twins = []
        for pid, trials in self.trials.items():
            hit = next((owner[k] for k in twin_keys(trials[0].problem, trials[0].content_key) if k in owner), None)
            if hit is not None:
                twins.append((pid, hit))
        return twins

    def attempts(self, problem_id: str, k: int, kind: str | None = None) -> list[Trial]:
        """The k newest trials on this problem (of this kind, when given), newest first."""
        return [t for t in self.trials.get(problem_id, [])[::-1] if kind in (None, t.kind)][:k]

    def similar(self, problem_text: str, k: int, exclude_id: str | None = None, content_key: str = "",
                solved: bool = False) -> list[tuple[float, list[Trial]]]:
        """Up to k other problems most similar to `problem_text`, best first, each as (score, its trials
        newest first). Neither `exclude_id` nor a twin of the query (its text up to layout, or its
        `content_key`; any id) is offered. solved: only problems with a kept trial of reward > 0."""
        exclude = {pid for key in twin_keys(problem_text, content_key) for pid in self.ids_by_key.get(key, ())}
        exclude |= {exclude_id} - {None}
        if solved:
            exclude |= {pid for pid, trials in self.trials.items() if not any(t.reward > 0 for t in trials)}
        hits = self.index.query(problem_text, k, exclude)
        return [(score, self.trials[pid][::-1]) for pid, score in hits]

    def save(self, path: str | Path) -> None:
        """JSON Lines, oldest trial first; written to a temporary file and renamed (atomic)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        everything = sorted((t for ts in self.trials.values() for t in ts), key=lambda t: t.step)
        with open(tmp, "w", encoding="utf-8") as f:
            for trial in everything:
                line = json.dumps(asdict(trial), ensure_ascii=False)
                try:
                    line.encode("utf-8")
                except UnicodeEncodeError:  # lone surrogates cannot be UTF-8: escape this line, exactly
                    line = json.dumps(asdict(trial))
                f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: str | Path) -> None:
        """Replace the contents with the trials saved at `path` (the index is rebuilt from them)."""
        for problem_id in list(self.trials):
            self.index.remove(problem_id)
        self.trials.clear()
        self.ids_by_key.clear()
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                try:
                    self.add([Trial(**json.loads(line))])
                except (json.JSONDecodeError, TypeError, ValueError) as e:
                    raise SystemExit(f"{path}: line {line_no} is not a pool trial: {e}") from None
