"""Reward-agnostic reflection (intra-sample feedback): the model's own earlier attempt(s) at a problem,
shortened to a token budget, go into a prompt (prompts.reflection_request) that shows them as attempts that
may or may not be right and asks for a critical check and a fresh solution. Training and evaluate.py both
build reflection prompts with `reflection_prompt`.
"""

from __future__ import annotations

import prompts
from prompts import encodable

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


def reflection_prompt(tokenizer, problem: str, attempts: list[str], *, attempt_tokens: int, one_shot: bool,
                      mode: str = "agnostic", rewards: list[float] = (), gold: str = "") -> tuple[str, str]:
    """(the rendered reflection prompt, the attempts as shown) for earlier attempts, newest first. `mode`
    other than agnostic is a leaky ablation (--reflect-mode), the only way rewards or the gold answer enter."""
    shown = [shorten(a, tokenizer, attempt_tokens) for a in attempts]
    if mode == "agnostic":
        request = prompts.reflection_request(problem, shown)
    else:
        request = prompts.leaky_reflection_request(problem, shown, mode, list(rewards), gold)
    return prompts.render_prompt(tokenizer, request, one_shot), "\n\n".join(shown)
