"""Reward-agnostic reflection (intra-sample feedback): the model's own earlier attempt(s) at a problem,
shortened to a token budget, go into a prompt (prompts.reflection_request) that shows them as attempts that
may or may not be right and asks for a critical check and a fresh solution. Training and evaluate.py both
build reflection prompts with `reflection_prompt`, and every --reflect-mode is one entry of `MODES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Mode:
    """A --reflect-mode: its request text from (problem, the attempts as shown, their rewards, the gold answer),
    whether it reads those labels (a leaky ablation), and the fewest earlier attempts it needs."""
    request: Callable[[str, list[str], list[float], str], str]
    reads_labels: bool
    least_attempts: int = 1


# every reflection mode, read by training, evaluate.py and the --reflect-mode choices
MODES = {
    "agnostic": Mode(lambda problem, shown, rewards, gold: prompts.reflection_request(problem, shown), False),
    "with-reward": Mode(lambda problem, shown, rewards, gold: prompts.leaky_reflection_request(
        problem, shown, "with-reward", rewards, gold), True),
    "with-gold": Mode(lambda problem, shown, rewards, gold: prompts.leaky_reflection_request(
        problem, shown, "with-gold", rewards, gold), True),
}


def reflection_prompt(tokenizer, problem: str, attempts: list[str], *, attempt_tokens: int, one_shot: bool,
                      mode: str = "agnostic",
                      labels: Callable[[], tuple[list[float], str]] | None = None) -> tuple[str, str]:
    """(the rendered reflection prompt, the attempts as shown) for earlier attempts, newest first. `labels`
    gives (the attempts' rewards, the gold answer) and is called only by a mode that reads them (the leaky
    ablations of --reflect-mode): reward-agnostic reflection never calls it."""
    spec = MODES[mode]
    if len(attempts) < spec.least_attempts:
        raise ValueError(f"--reflect-mode {mode} needs {spec.least_attempts} earlier attempts, got {len(attempts)}")
    shown = [shorten(a, tokenizer, attempt_tokens) for a in attempts]
    rewards, gold = labels() if spec.reads_labels else ([], "")
    request = spec.request(problem, shown, list(rewards), gold)
    return prompts.render_prompt(tokenizer, request, one_shot), "\n\n".join(shown)
