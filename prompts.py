"""Every prompt the policy sees is worded and rendered here: the plain problem, reward-agnostic reflection
(and its leaky ablations), relevance judgements, principles, the prompt with principles or raw trajectories,
and RLTF-FM's target prompt. Training, evaluate.py and bench/ all build their prompts from these functions,
so changing a prompt is one diff in this file.

`reflection_request` takes the problem and the attempt texts only. It has no parameter through which a
reward, a verdict or the gold answer could enter: label leakage is impossible by construction. The leaky
variants of the paper's failure cases live apart, in `leaky_reflection_request`, and exist only to be
measured against (`--reflect-mode with-reward|with-gold`).

Untrusted text (problems, earlier model outputs, principles) passes through `neutralize`, so a response
that contains a chat-special token such as `<|im_start|>` cannot open a forged turn in a later prompt.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pool import Trial

FORMAT_INSTRUCTION = "Put your final answer in \\boxed{}."

# One worked example as a prior chat turn. Small models (SmolLM2-135M) almost never box an answer without
# it (about 1 in 10 samples, measured); with it they do in nearly every sample. Strong models: --no-one-shot.
ONE_SHOT = [
    {"role": "user", "content": f"What is 2 + 5?\n{FORMAT_INSTRUCTION}"},
    {"role": "assistant", "content": "2 + 5 = 7. The answer is \\boxed{7}."},
]

ZERO_WIDTH_SPACE = "\u200b"


def encodable(text: str) -> str:
    """Lone surrogates (from bytes decoded with surrogateescape) cannot be tokenized: U+FFFD instead."""
    return re.sub("[\ud800-\udfff]", "\ufffd", text)


def neutralize(text: str, special_tokens: list[str]) -> str:
    """Break every special-token string in `text` with a zero-width space, so the tokenizer reads it as
    ordinary characters, never as a control token; lone surrogates (not encodable) become U+FFFD."""
    text = encodable(text)
    for token in special_tokens:
        if len(token) > 1 and token in text:
            text = text.replace(token, token[0] + ZERO_WIDTH_SPACE + token[1:])
    return text


def special_token_strings(tokenizer) -> list[str]:
    """All strings the tokenizer would turn into special/added tokens (longest first)."""
    strings = set(tokenizer.all_special_tokens)
    strings.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values())
    return sorted(strings, key=len, reverse=True)


def problem_request(problem: str) -> str:
    """The user turn for solving a problem from scratch."""
    return f"{problem}\n{FORMAT_INSTRUCTION}"


def render_prompt(tokenizer, user_content: str, one_shot: bool) -> str:
    """Prompt text for generation: [worked example,] one user turn, assistant turn opened. The user
    content is neutralized whole: our own wording has no special tokens, so only untrusted text changes."""
    content = neutralize(user_content, special_token_strings(tokenizer))
    messages = (list(ONE_SHOT) if one_shot else []) + [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ------------------------------------------------------------------------------- intra-sample: reflection

def _attempt_block(attempts: list[str]) -> str:
    if len(attempts) == 1:
        return f"Earlier attempt:\n{attempts[0]}"
    return "\n\n".join(f"Earlier attempt {i}:\n{a}" for i, a in enumerate(attempts, 1))


def reflection_request(problem: str, attempts: list[str]) -> str:
    """User turn asking for a critical review of earlier attempts, then a fresh solution."""
    if not attempts:
        raise ValueError("reflection needs at least one earlier attempt")
    noun = "attempt" if len(attempts) == 1 else "attempts"
    return (f"Problem: {problem}\n\n{_attempt_block(attempts)}\n\n"
            f"The earlier {noun} above may or may not contain mistakes. Check every step critically, "
            f"then solve the problem yourself from the beginning.\n{FORMAT_INSTRUCTION}")


def leaky_reflection_request(problem: str, attempts: list[str], mode: str, rewards: list[float],
                             gold: str) -> str:
    """ABLATION ONLY. `with-reward` tells whether each attempt was correct; `with-gold` shows the gold
    answer. These are the label-leaking baselines the paper shows to fail; never use them for real runs."""
    if mode == "with-reward":
        verdicts = ["correct" if r > 0 else "incorrect" for r in rewards]
        shown = [f"{a}\n(This attempt was {v}.)" for a, v in zip(attempts, verdicts)]
        return reflection_request(problem, shown)
    if mode == "with-gold":
        return reflection_request(problem, attempts) + f"\nThe correct final answer is {gold}."
    raise ValueError(f"leaky reflection mode must be 'with-reward' or 'with-gold', got {mode!r}")


# ------------------------------------------------------------------------------- inter-sample: abstraction

# the two answers a relevance request asks for; abstract.relevance_scores compares their first tokens
RELEVANCE_ANSWERS = ("Yes", "No")


# --relevance-question: what the judge is asked, (with the candidate's solution, with its problem only).
# `approach` is the paper's question; `operation` asks whether the two problems are one computation with other
# numbers, which Qwen2.5-Coder-1.5B ranks better on synthetic:rules (docs/evaluation.md, the judge's wordings)
RELEVANCE_QUESTIONS = {
    "approach": ("Is the approach used to solve problem B relevant and useful for solving problem A?",
                 "Is the approach that solves problem B relevant and useful for solving problem A?"),
    "operation": ("Do problems A and B ask for exactly the same operation, so that the method of this solution, "
                  "applied to problem A's numbers, gives problem A's answer?",
                  "Do problems A and B ask for exactly the same operation, so that the method that solves B, "
                  "applied to problem A's numbers, solves A?"),
}


def relevance_request(problem: str, other_problem: str, other_solution: str | None,
                      question: str = "approach") -> str:
    """Asks whether another problem's approach is relevant (answered with RELEVANCE_ANSWERS; scored, never
    generated). With `other_solution` None (--relevance-text problem) the judgement rests on the two problem
    statements. `question`: a key of RELEVANCE_QUESTIONS."""
    yes, no = RELEVANCE_ANSWERS
    with_solution, problem_only = RELEVANCE_QUESTIONS[question]
    if other_solution is None:
        return f"Problem A: {problem}\n\nProblem B: {other_problem}\n\n{problem_only} Answer with {yes} or {no}."
    return (f"Problem A: {problem}\n\nProblem B: {other_problem}\n\nA solution of problem B:\n{other_solution}\n\n"
            f"{with_solution} Answer with {yes} or {no}.")


def principles_request(problem: str, experiences: list[Trial]) -> str:
    """Ask for short, general principles drawn from related solved (or failed) problems."""
    blocks = []
    for i, t in enumerate(experiences, 1):
        verdict = "correct" if t.reward > 0 else "incorrect"
        blocks.append(f"Example {i} (its final answer was {verdict}):\nProblem: {t.problem}\nSolution: {t.response}")
    examples = "\n\n".join(blocks)
    return (f"{examples}\n\nNew problem: {problem}\n\n"
            "From the examples above, write at most three short, general principles (methods, checks, "
            "common mistakes) that would help solve the new problem. Do not solve the new problem. Do not "
            "copy numbers or final answers from the examples.")


def raw_experience_block(experiences: list[Trial]) -> str:
    """ABLATION (`--abstract-mode raw`): the retrieved trajectories themselves, each with its verdict as the
    principles request shows it (another problem's reward, never the current problem's label): without it a
    raw trial cannot tell a rule from a mistake."""
    return "\n\n".join(f"Related problem: {t.problem}\nA solution (its final answer was "
                       f"{'correct' if t.reward > 0 else 'incorrect'}): {t.response}" for t in experiences)


def abstraction_request(problem: str, lessons: str, raw: bool = False) -> str:
    """User turn for solving a problem with lessons (principles, or raw trajectories in the ablation)."""
    header = "Here are solutions of related problems:" if raw else "Here are some general principles that may help:"
    return f"{header}\n{lessons}\n\nProblem: {problem}\n{FORMAT_INSTRUCTION}"


def answer_hint_request(problem: str, gold: str) -> str:
    """PROBE ONLY (bench/context_probe.py): the gold answer stated beside the problem, the ceiling of what any
    context could give. Never built in training or evaluation."""
    return f"{problem}\nThe correct final answer is {gold}.\n{FORMAT_INSTRUCTION}"


def feedback_model_request(problem: str, attempt: str) -> str:
    """User turn of RLTF-FM: the problem and the model's own attempt; the principles are the target. The
    wording follows principles_request, whose answer the principles are."""
    return (f"Problem: {problem}\n\nAn attempt at it:\n{attempt}\n\n"
            "Write at most three short, general principles (methods, checks, common mistakes) that would "
            "help solve this problem. Do not solve the problem.")
