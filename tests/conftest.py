"""Shared fixtures: a tiny randomly initialised chat model with its own byte-level BPE tokenizer, built
inside the tests (no hub, no download), saved once per session as a normal transformers directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer():
    """A byte-level BPE chat tokenizer (400 tokens, ChatML template) trained on a few lines: no hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["What is 2 + 5? Put your final answer in \\boxed{}. The answer is \\boxed{7}.",
              "Tom has 12 apples and gets 3 more. How many apples now? 0 1 2 3 4 5 6 7 8 9",
              "Review the earlier attempt critically, then solve. Principles: check each step.",
              "Is the approach relevant? Yes No. abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHATML
    return tokenizer


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = [config.eos_token_id, tokenizer.pad_token_id]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


SUITE_SIZE = {}  # "all": how many tests the default suite holds, when this session collected all of it


def pytest_collection_finish(session):
    """Count the suite when the session is the whole of it (no paths, -k or -m): the docs' test count is held to it."""
    cfg = session.config
    if cfg.args_source == pytest.Config.ArgsSource.TESTPATHS and not cfg.option.keyword and not cfg.option.markexpr:
        SUITE_SIZE["all"] = len(session.items)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """(model, tokenizer) loaded through the project's own loader."""
    import torch

    import models

    tokenizer = models.load_tokenizer(str(tiny_model_dir))
    model = models.load_policy(str(tiny_model_dir), torch.float32)
    return model, tokenizer


@pytest.fixture(autouse=True)
def fp32_by_default(monkeypatch):
    """In-process runs read --dtype auto as on a CPU without native bf16 (fp32), on every machine: the exact
    numbers the tests pin are fp32's. Tests of bf16 say --dtype bf16-mixed, or patch cpu.native_bf16 back."""
    import cpu

    monkeypatch.setattr(cpu, "native_bf16", lambda cpuinfo=None: "")


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """In-process runs each create an Accelerator; its state is a process-wide singleton that would keep
    the first run's settings (e.g. mixed precision). Reset it after every test."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


MEASURED = ("time_", "tokens_per_s", "memory_")  # metric columns that measure the machine, not the training


def training_metrics(path: Path) -> list[dict]:
    """metrics.jsonl (a file, or the run directory holding it) without the machine-measurement columns."""
    path = path / "metrics.jsonl" if path.is_dir() else path
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(MEASURED)}
            for line in path.read_text().splitlines()]


def fake_grade(response: str, gold: str, timeout: float = 5.0, truncated: bool = False) -> float:
    """The random model never answers right: reward length parity so every group has signal (cut or not)."""
    return float(len(response) % 2 == 0)


@pytest.fixture
def graded_by_parity(monkeypatch):
    import math_grader

    monkeypatch.setattr(math_grader, "grade", fake_grade)
