"""Reward-agnostic reflection (intra-sample feedback): a prompt that shows the model its own earlier
attempt(s) at a problem, as attempts that may or may not be right, and asks it to check them critically
and solve the problem again.

`reflection_request` takes the problem and the attempt texts only. It has no parameter through which a
reward, a verdict or the gold answer could enter: label leakage is impossible by construction.
The leaky variants of the paper's failure cases live apart, in `leaky_reflection_request`, and exist
only to be measured against (`--reflect-mode with-reward|with-gold`).
"""

from __future__ import annotations

from prompts import FORMAT_INSTRUCTION, encodable

ELISION = "\n[... middle of the attempt omitted ...]\n"


def shorten(text: str, tokenizer, max_tokens: int) -> str:
    """Keep the first and last tokens of a long attempt (the approach and the final answer) within
    `max_tokens`; the middle is replaced by a marker."""
    text = encodable(text)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    head = max_tokens // 2
    tail = max_tokens - head
    return (tokenizer.decode(ids[:head], skip_special_tokens=True) + ELISION
            + tokenizer.decode(ids[-tail:], skip_special_tokens=True))


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
