"""prompts.py: every prompt's exact wording, so that a change of what the policy reads is a deliberate diff here
(and of the golden runs), never a side effect; untrusted text neutralized."""

import copy

import pytest

import prompts
from pool import Trial

FORMAT = "Put your final answer in \\boxed{}."


def experience(problem: str, response: str, reward: float) -> Trial:
    return Trial("id", problem, "scratch", "", response, reward, 1)


def test_plain_and_reflection_requests_word_for_word():
    assert prompts.problem_request("What is 2 + 5?") == f"What is 2 + 5?\n{FORMAT}"
    assert prompts.reflection_request("P?", ["a1"]) == (
        "Problem: P?\n\nEarlier attempt:\na1\n\nThe earlier attempt above may or may not contain mistakes. Check "
        f"every step critically, then solve the problem yourself from the beginning.\n{FORMAT}")
    assert prompts.reflection_request("P?", ["a1", "a2"]) == (
        "Problem: P?\n\nEarlier attempt 1:\na1\n\nEarlier attempt 2:\na2\n\nThe earlier attempts above may or may "
        "not contain mistakes. Check every step critically, then solve the problem yourself from the beginning.\n"
        f"{FORMAT}")
    with pytest.raises(ValueError, match="^reflection needs at least one earlier attempt$"):
        prompts.reflection_request("P?", [])


def test_leaky_reflection_ablations_word_for_word():
    assert prompts.leaky_reflection_request("P?", ["a1", "a2"], "with-reward", [1.0, 0.0], "7") == \
        prompts.reflection_request("P?", ["a1\n(This attempt was correct.)", "a2\n(This attempt was incorrect.)"])
    assert prompts.leaky_reflection_request("P?", ["a1"], "with-gold", [0.0], "7") == \
        prompts.reflection_request("P?", ["a1"]) + "\nThe correct final answer is 7."
    with pytest.raises(ValueError, match="leaky reflection mode must be 'with-reward' or 'with-gold', got 'agnostic'"):
        prompts.leaky_reflection_request("P?", ["a1"], "agnostic", [0.0], "7")


def test_abstraction_prompts_word_for_word():
    assert prompts.relevance_request("A?", "B?", "sol") == (
        "Problem A: A?\n\nProblem B: B?\n\nA solution of problem B:\nsol\n\nIs the approach used to solve problem B "
        "relevant and useful for solving problem A? Answer with Yes or No.")
    assert prompts.relevance_request("A?", "B?", None) == (
        "Problem A: A?\n\nProblem B: B?\n\nIs the approach that solves problem B relevant and useful for solving "
        "problem A? Answer with Yes or No.")
    shown = [experience("B?", "b", 1.0), experience("C?", "c", 0.0)]
    assert prompts.principles_request("A?", shown) == (
        "Example 1 (its final answer was correct):\nProblem: B?\nSolution: b\n\n"
        "Example 2 (its final answer was incorrect):\nProblem: C?\nSolution: c\n\nNew problem: A?\n\n"
        "From the examples above, write at most three short, general principles (methods, checks, common "
        "mistakes) that would help solve the new problem. Do not solve the new problem. Do not copy numbers or "
        "final answers from the examples.")
    assert prompts.raw_experience_block(shown) == (
        "Related problem: B?\nA solution (its final answer was correct): b\n\n"
        "Related problem: C?\nA solution (its final answer was incorrect): c")
    assert prompts.answer_hint_request("A?", "12") == f"A?\nThe correct final answer is 12.\n{FORMAT}"
    assert prompts.abstraction_request("A?", "L") == (
        f"Here are some general principles that may help:\nL\n\nProblem: A?\n{FORMAT}")
    assert prompts.abstraction_request("A?", "L", raw=True) == (
        f"Here are solutions of related problems:\nL\n\nProblem: A?\n{FORMAT}")
    assert prompts.feedback_model_request("A?", "att") == (
        "Problem: A?\n\nAn attempt at it:\natt\n\nWrite at most three short, general principles (methods, checks, "
        "common mistakes) that would help solve this problem. Do not solve the problem.")


def test_untrusted_text_cannot_forge_a_turn_or_break_encoding():
    specials = ["<|im_start|>", "<|im_end|>", "<s", "x"]  # one-character strings are left alone
    assert prompts.neutralize("a<|im_end|>b<|im_start|>x<s", specials) == \
        "a<\u200b|im_end|>b<\u200b|im_start|>x<\u200bs"
    assert prompts.encodable("ok\udcff\ud800!") == "ok\ufffd\ufffd!"
    assert prompts.neutralize("bad \udcff", specials) == "bad \ufffd"


def test_rendering_adds_the_worked_example_only_when_asked(tiny):
    _, tokenizer = tiny
    # the special and added tokens, longest first (so a longer one is broken before a shorter one inside it)
    assert prompts.special_token_strings(tokenizer) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    added = copy.deepcopy(tokenizer)  # a token added as special text only (a tool tag), in no special map
    added.add_tokens(["<tool>"], special_tokens=True)
    assert "<tool>" not in added.all_special_tokens
    assert prompts.special_token_strings(added) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"]
    plain = prompts.render_prompt(tokenizer, "Q<|im_end|>", one_shot=False)
    assert plain == "<|im_start|>user\nQ<\u200b|im_end|><|im_end|>\n<|im_start|>assistant\n"
    shot = prompts.render_prompt(tokenizer, "Q", one_shot=True)
    assert shot == ("<|im_start|>user\nWhat is 2 + 5?\nPut your final answer in \\boxed{}.<|im_end|>\n"
                    "<|im_start|>assistant\n2 + 5 = 7. The answer is \\boxed{7}.<|im_end|>\n"
                    "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n")


def test_the_operation_question_is_worded_as_measured():
    assert prompts.relevance_request("A?", "B?", None, "operation") == (
        "Problem A: A?\n\nProblem B: B?\n\nDo problems A and B ask for exactly the same operation, so that the "
        "method that solves B, applied to problem A's numbers, solves A? Answer with Yes or No.")
    assert prompts.relevance_request("A?", "B?", "sol", "operation") == (
        "Problem A: A?\n\nProblem B: B?\n\nA solution of problem B:\nsol\n\nDo problems A and B ask for exactly the "
        "same operation, so that the method of this solution, applied to problem A's numbers, gives problem A's "
        "answer? Answer with Yes or No.")
