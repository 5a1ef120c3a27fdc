"""The prepared GPU check (bench/gpu_engines.py) run as its CPU twin: the same three set-ups (LoRA, full
bf16, ZeRO-3 in one process) through the same code, on Qwen2-architecture tiny shapes, so the script
cannot rot while no GPU is lent."""

import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu_engines  # noqa: E402


def test_gpu_check_cpu_twin_runs_every_setup(tmp_path):
    out = tmp_path / "gpu_engines.json"
    report = gpu_engines.main(["--shapes", "tiny", "--cpu", "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert set(report["setups"]) == {"lora", "full-bf16", "zero3"}
    for name, result in report["setups"].items():
        assert result["ok"], (name, result.get("error"))
        assert len(result["step_s"]) == 2 and result["peak_memory_gb"] > 0 and min(result["tokens_per_s"]) > 0
        assert result["layers"] == gpu_engines.TINY["num_hidden_layers"]  # half depth is for the 7B shapes only
    assert not (tmp_path / "work").exists()  # the 7B model and its runs are removed
