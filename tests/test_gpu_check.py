"""The prepared GPU checks run as their CPU twins, through the same code on Qwen2-architecture tiny shapes, so
the scripts cannot rot while no GPU is lent: bench/gpu_engines.py (LoRA, full bf16 eager and compiled, ZeRO-3 in
one process) and bench/decode_overhead.py (eager, compiled, LoRA through adapters and merged)."""

import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import decode_overhead  # noqa: E402
import gpu_engines  # noqa: E402


def test_gpu_check_cpu_twin_runs_every_setup(tmp_path):
    out = tmp_path / "gpu_engines.json"
    report = gpu_engines.main(["--shapes", "tiny", "--cpu", "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert set(report["setups"]) == {"lora", "full-bf16", "full-bf16-compiled", "zero3"}
    for name, result in report["setups"].items():
        assert result["ok"], (name, result.get("error"))
        assert len(result["step_s"]) == 2 and result["peak_memory_gb"] > 0 and min(result["tokens_per_s"]) > 0
        assert result["layers"] == gpu_engines.TINY["num_hidden_layers"]  # half depth is for the 7B shapes only
    assert not (tmp_path / "work").exists()  # the 7B model and its runs are removed


def test_decoding_check_cpu_twin_measures_every_setup_against_the_limit(tmp_path):
    out = tmp_path / "decode.json"
    report = decode_overhead.main(["--shapes", "tiny", "--passes", "2", "--steps", "8", "--batch", "4",
                                   "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["bandwidth_gb_s"] > 0 and report["limit_ms"] == 1000 * report["weight_gb"] / report["bandwidth_gb_s"]
    # the tiny model's weights: 2 layers of (q, k, v, o, gate, up, down) + biases + norms, the LM head, in bf16
    params = sum(q.numel() for q in gpu_engines.random_model("tiny", "cpu")[0].parameters())
    embedding = gpu_engines.TINY["vocab_size"] * gpu_engines.TINY["hidden_size"]
    assert report["weight_gb"] == (params - embedding) * 2 / 1e9
    assert set(report["summary"]) == {f"{s}/4" for s in decode_overhead.SETUPS}
    assert report["compile_s"]["compiled/4"] > 0 and report["compile_s"]["eager/4"] == 0
    assert report["recompiled_in_passes"] == 0  # the warm-up compiled every shape the passes use
    for name, row in report["summary"].items():
        assert len(report["ms"][name.split("/")[0]]["4"]) == 2 and row["tokens_per_s"] > 0
    assert report["summary"]["lora-merged/4"]["vs"] == "lora" and report["summary"]["compiled/4"]["vs"] == "eager"
