"""Relevant abstraction (inter-sample feedback): lessons from similar *other* problems in the pool.

1. candidates: `pool.similar(problem)` gives the top-K other problems with their trials (their rewards
   may be used: they are not the current problem's labels);
2. relevance: the policy judges, in one batched forward pass without generation, whether each
   candidate's approach is relevant to the current problem; score = P(Yes) normalised over {Yes, No};
   candidates with score >= gamma are kept (gamma = 0 keeps all);
3. abstraction: one batched `generate` call distils the kept experiences of each problem into a few
   short, general principles, which go into that problem's prompt. `raw` mode (an ablation) injects
   the retrieved trajectories themselves instead.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field, replace

import torch

import prompts
from data import content_key
from forwards import cache_kwarg, position_ids
from math_grader import extract_answer
from pool import ExperiencePool, Trial
from prompts import principles_request, raw_experience_block, relevance_request, render_prompt
from reflect import shorten
from rollout import generate_completions, shared_prefill


def best_trial(trials: list[Trial]) -> Trial:
    """The trial that shows a candidate's approach best: the newest correct one, else the newest."""
    return next((t for t in trials if t.reward > 0), trials[0])


@torch.no_grad()
def relevance_scores(model, tokenizer, pairs: list[str], owners: list[int] | None = None, batch_size: int = 16,
                     share_prefix: bool = False) -> list[float]:
    """P(Yes) / (P(Yes) + P(No)) for the first token of the assistant's answer to each relevance request (the
    two words are prompts.RELEVANCE_ANSWERS, their ids this tokenizer's first token of each).
    The full-vocabulary P(Yes) of a small model is tiny even when it prefers Yes; normalising over the two
    answers makes gamma mean the same thing for every model (0.9 = nine-to-one odds for Yes).

    share_prefix: `owners[i]` is the problem that pair i is judged for; the pairs of one problem start alike
    (chat template, that problem) and differ in the candidate. Each problem's common start is encoded once
    (`shared_prefill`: the start all pairs of a batch share once, then each problem's rest) and its pairs'
    candidates attend to that KV cache. The same scores up to float rounding; a batch keeps a problem's pairs
    together where it can."""
    yes_id, no_id = (tokenizer.encode(word, add_special_tokens=False)[0] for word in prompts.RELEVANCE_ANSWERS)
    # no worked example: it teaches the \boxed format of math answers, not Yes/No judgements
    texts = [render_prompt(tokenizer, p, one_shot=False) for p in pairs]
    was_training = model.training
    model.eval()
    if share_prefix:
        if owners is None or len(owners) != len(pairs):
            raise ValueError("share_prefix needs the owner (judged problem) of every pair")
        logits = _shared_last_logits(model, tokenizer, texts, owners, batch_size)
    else:
        logits = []
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(model.device)
            logits += model(**enc, position_ids=position_ids(enc.attention_mask), logits_to_keep=1).logits[:, -1]
    model.train(was_training)
    if not logits:
        return []
    two = torch.log_softmax(torch.stack(logits).float()[:, [yes_id, no_id]], dim=-1)
    return two[:, 0].exp().tolist()


def _shared_last_logits(model, tokenizer, texts: list[str], owners: list[int], batch_size: int) -> list:
    """Last-position logits of each text, each owner's common token prefix encoded once (see relevance_scores)."""
    ids = tokenizer(texts, add_special_tokens=False).input_ids
    groups: dict[int, list[int]] = {}
    for row, owner in enumerate(owners):
        groups.setdefault(owner, []).append(row)
    batches, current = [], []  # whole groups per batch while they fit (longest first: less padding); a larger
    for rows in sorted(groups.values(), key=lambda rows: -max(len(ids[r]) for r in rows)):  # group is split
        for start in range(0, len(rows), batch_size):
            part = rows[start:start + batch_size]
            if len(current) + len(part) > batch_size:
                batches.append(current)
                current = []
            current += part
    if current:
        batches.append(current)
    out = [None] * len(texts)
    for rows in batches:
        # each row's "prompt": the token prefix its group's rows share in this batch, less at least one token
        start_of = {}
        for owner in dict.fromkeys(owners[r] for r in rows):
            mates = [r for r in rows if owners[r] == owner]
            common = len(os.path.commonprefix([ids[r] for r in mates]))
            start_of.update({r: min(common, min(len(ids[m]) for m in mates) - 1) for r in mates})
        prefix = {r: tuple(ids[r][:start_of[r]]) for r in rows}
        index: dict[tuple, int] = {}  # distinct prefix -> its row in the prefill
        for r in rows:
            index.setdefault(prefix[r], len(index))
        prompts = tokenizer.pad({"input_ids": [list(p) for p in index]}, return_tensors="pt").to(model.device)
        row_ids, row_mask, cache = shared_prefill(model, prompts.input_ids, prompts.attention_mask,
                                                  [index[prefix[r]] for r in rows])
        # then each row's last prompt token and its own tokens, left-padded so that every row ends in the last column
        tails = tokenizer.pad({"input_ids": [ids[r][start_of[r]:] for r in rows]}, return_tensors="pt").to(model.device)
        mask = torch.cat([row_mask, tails.attention_mask], dim=1)
        logits = model(input_ids=torch.cat([row_ids[:, -1:], tails.input_ids], dim=1), attention_mask=mask,
                       position_ids=position_ids(mask)[:, row_ids.shape[1] - 1:], use_cache=True, logits_to_keep=1,
                       **{cache_kwarg(): cache}).logits[:, -1]
        for row, logit in zip(rows, logits):
            out[row] = logit
    return out


def clean_principles(text: str, other_answers: list[str | None] = ()) -> str:
    """Principles must not carry final answers. Replaced by "[answer removed]": every \\boxed{...} or
    \\fbox{...} (nested braces included; an unclosed one, cut off by the length limit, takes the rest of
    its line), every "answer is X", and every whole-word occurrence of the final answers of the shown
    experiences that has two or more characters (single digits would also hit list numbering)."""
    out, pos = [], 0
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        if m.start() < pos:
            continue  # inside a box already removed
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:  # unclosed: drop to the end of the line
            newline = text.find("\n", m.end())
            i = len(text) if newline < 0 else newline
        out.append(text[pos:m.start()] + "[answer removed]")
        pos = i
    text = "".join(out) + text[pos:]
    text = re.sub(r"(answer (?:is|was|=)\s*)(?!\[answer removed\])[^\s,.;]+", r"\1[answer removed]", text,
                  flags=re.IGNORECASE)
    for answer in {a.strip() for a in other_answers if a and len(a.strip()) >= 2}:
        text = re.sub(r"(?<![\w.])" + re.escape(answer) + r"(?!\w|\.\d)", "[answer removed]", text)
    return text.strip()


@dataclass
class AbstractionStats:
    candidates: int = 0
    kept: int = 0
    scores: list[float] = field(default_factory=list)  # relevance scores of all candidates scored
    pairs: list[tuple[str, str]] = field(default_factory=list)  # (problem id, candidate's problem id) per candidate
    accepted: list[bool] = field(default_factory=list)  # per candidate: kept by the relevance filter
    made: int = 0           # principles generated this step (cache misses)
    cached: int = 0         # lessons served from the cache (a cached "nothing relevant" is cached_empty)
    cached_empty: int = 0
    principles_tokens: list[int] = field(default_factory=list)
    time_retrieval: float = 0.0
    time_relevance: float = 0.0
    time_abstraction: float = 0.0


def fresh_entry(cache: dict, problem_id: str, step: int, refresh: int) -> dict | None:
    """A problem's lessons-cache entry if it was made less than `refresh` steps before `step`, else None."""
    hit = cache.get(problem_id)
    return hit if hit is not None and step - hit["step"] < refresh else None


@dataclass
class PendingLessons:
    """Lessons half made: served from the cache, or judged and waiting for their principles to be generated."""
    lessons: dict[str, str]           # problem id -> lessons ready now (cache hits; raw mode: all)
    todo: list[tuple[dict, list[Trial]]]  # problems judged this time, with the experiences shown to the judge
    kept: list[list[Trial]]           # per todo problem: the experiences judged relevant
    requests: list[str]               # rendered principles requests, one per todo problem with kept experiences
    stats: AbstractionStats


def prepare_lessons(model, tokenizer, pool: ExperiencePool, problems: list[dict], cache: dict, step: int,
                    cfg, families: dict[str, str] | None = None) -> PendingLessons:
    """Steps 1 and 2 (candidates, relevance) for each problem whose cache entry is missing or older than
    --abstract-refresh steps; cache hits are served as they are. What is left to generate is in `requests`.
    cfg (config.Config) gives K (--abstract-candidates), gamma (--relevance-threshold), --relevance-top,
    --relevance-question, --relevance-judge, --abstract-mode, --attempt-tokens, --relevance-text and
    --share-prefill. `families` (problem id -> family) scores the candidates under --relevance-judge family."""
    gamma, mode = cfg.relevance_threshold, cfg.abstract_mode
    stats = AbstractionStats()
    lessons: dict[str, str] = {}
    todo: list[tuple[dict, list[Trial]]] = []
    pairs, owners = [], []

    t0 = time.perf_counter()
    for p in problems:
        hit = fresh_entry(cache, p["id"], step, cfg.abstract_refresh)
        if hit is not None:
            if hit["lessons"]:
                lessons[p["id"]] = hit["lessons"]
                stats.cached += 1
            else:
                stats.cached_empty += 1
            continue
        found = pool.similar(p["problem"], cfg.abstract_candidates, exclude_id=p["id"], content_key=content_key(p),
                             solved=cfg.abstract_from == "solved")
        shown = [best_trial(trials) for _, trials in found]
        shown = [replace(t, response=shorten(t.response, tokenizer, cfg.attempt_tokens)) for t in shown]
        stats.candidates += len(shown)
        stats.pairs += [(p["id"], t.problem_id) for t in shown]
        todo.append((p, shown))
        for t in shown:
            solution = t.response if cfg.relevance_text == "experience" else None
            pairs.append(relevance_request(p["problem"], t.problem, solution, cfg.relevance_question))
            owners.append(len(todo) - 1)
    stats.time_retrieval = time.perf_counter() - t0

    t0 = time.perf_counter()
    kept: list[list[Trial]] = [[] for _ in todo]
    if (gamma > 0 or cfg.relevance_top) and pairs:
        flat = [t for _, shown in todo for t in shown]
        if cfg.relevance_judge == "family":  # the oracle: the query's own family scores 1
            scores = [float(families[todo[o][0]["id"]] == families[t.problem_id]) for o, t in zip(owners, flat)]
        else:
            scores = relevance_scores(model, tokenizer, pairs, owners, share_prefix=cfg.share_prefill)
        stats.scores = scores
        passed: list[list[tuple[float, int, Trial]]] = [[] for _ in todo]
        for i, (owner, t, s) in enumerate(zip(owners, flat, scores)):
            if s >= gamma:
                passed[owner].append((s, i, t))
        if cfg.relevance_top:  # the N best of each problem, then back in retrieval order
            passed = [sorted(sorted(p, key=lambda x: -x[0])[:cfg.relevance_top], key=lambda x: x[1]) for p in passed]
        kept = [[t for _, _, t in p] for p in passed]
    else:  # gamma = 0: no filter, no forward pass
        kept = [shown for _, shown in todo]
    stats.accepted = [any(t is x for x in k) for (_, shown), k in zip(todo, kept) for t in shown]
    stats.kept = sum(len(k) for k in kept)
    stats.time_relevance = time.perf_counter() - t0
    requests = [] if mode == "raw" else [render_prompt(tokenizer, principles_request(p["problem"], k), one_shot=False)
                                         for (p, _), k in zip(todo, kept) if k]
    return PendingLessons(lessons, todo, kept, requests, stats)


def finish_lessons(pending: PendingLessons, outs: list, cache: dict, step: int, mode: str) -> dict[str, str]:
    """Step 3 from the generated principles (`outs`, one per request; raw mode: none): clean them, cache
    every judged problem's result under `step`, and return all lessons."""
    needs = [(p, k) for (p, _), k in zip(pending.todo, pending.kept) if k]
    if mode == "raw":
        made = [raw_experience_block(k) for _, k in needs]
    else:
        made = [clean_principles(o.text, [extract_answer(t.response) for t in k]) for o, (_, k) in zip(outs, needs)]
        pending.stats.principles_tokens = [len(o.completion_ids) for o in outs]
    pending.stats.made = len(made)
    by_id = {p["id"]: text for (p, _), text in zip(needs, made)}
    lessons = dict(pending.lessons)
    for p, shown in pending.todo:
        text = by_id.get(p["id"], "")
        if shown:  # with no candidates at all there is nothing to reuse: ask the (growing) pool next step
            cache[p["id"]] = {"step": step, "lessons": text}
        if text:
            lessons[p["id"]] = text
    return lessons


def lessons_for(model, tokenizer, pool: ExperiencePool, problems: list[dict], cache: dict, step: int, cfg,
                eos_ids: list[int], families: dict[str, str] | None = None) -> tuple[dict[str, str], AbstractionStats]:
    """Lessons (principles, or raw trajectories under --abstract-mode raw) for each problem that has relevant
    experience in the pool; problems without any are absent from the result. cfg is config.Config: besides
    prepare_lessons' settings, principles are generated greedily up to --abstract-max-tokens, --gen-batch
    prompts a call.

    --relevance-text: what the relevance judgement sees of a candidate: its problem and shown solution
    (experience), or its problem statement only (problem: about a third of the tokens).
    --share-prefill: prompts' common starts are encoded once, in the relevance forward and in generation.
    --compile-decoding: the principles are decoded by the compiled step (rollout.generate_completions).

    `cache` maps problem id -> {"step", "lessons"} and is updated in place; an entry (also "all
    candidates judged irrelevant") is reused for --abstract-refresh steps, then rebuilt (the pool has grown
    and the policy has changed)."""
    pending = prepare_lessons(model, tokenizer, pool, problems, cache, step, cfg, families)
    t0 = time.perf_counter()
    outs = []
    if pending.requests:
        outs = generate_completions(model, tokenizer, pending.requests, eos_ids=eos_ids,
                                    max_new_tokens=cfg.abstract_max_tokens, greedy=True, batch_size=cfg.gen_batch,
                                    share_prefill=cfg.share_prefill, compiled=cfg.compile_decoding)
    lessons = finish_lessons(pending, outs, cache, step, cfg.abstract_mode)
    pending.stats.time_abstraction = time.perf_counter() - t0
    return lessons, pending.stats


def hidden_state_embedder(model, tokenizer):
    """embed(texts) for `--retriever policy`: the policy's mean-pooled last hidden states (no extra model)."""
    @torch.no_grad()
    def embed(texts: list[str]):
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        hidden = model(**enc, position_ids=position_ids(enc.attention_mask), output_hidden_states=True,
                       logits_to_keep=1).hidden_states[-1].float()
        mask = enc.attention_mask[..., None].float()
        return ((hidden * mask).sum(1) / mask.sum(1)).cpu().numpy()
    return embed
