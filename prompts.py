"""Every prompt the policy sees is rendered here: the plain problem prompt, and the chat wrapper that the
reflection and abstraction modules put their feedback into. One place, so a prompt change is one diff.

Untrusted text (problems, earlier model outputs, principles) passes through `neutralize`, so a response
that contains a chat-special token such as `<|im_start|>` cannot open a forged turn in a later prompt.
"""

from __future__ import annotations

import re

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
