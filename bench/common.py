"""What the bench scripts share: an argument parser described by the script's docstring (with --model and --out),
a result written as JSON, and this machine's peaks (fp32 matmul rate, copy bandwidth) with the roofline they
give. A script puts the repository root on the import path before importing this module."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import models


def parser(doc: str, out: str) -> argparse.ArgumentParser:
    """The script's argument parser: its docstring's first paragraph, --model (default: the embedded model) and
    --out (where the JSON result goes, default `out`)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", default=models.EMBEDDED)
    ap.add_argument("--out", default=out, help="where the result goes (JSON)")
    return ap


def save_json(result, out: str, indent: int = 2) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=indent))


def _best_rate(fn, work: float, seconds: float, sync=lambda: None) -> float:
    """work / seconds of the fastest of repeated calls of fn (at least 3, for about `seconds`), after a warm-up.
    sync waits for the device (CUDA runs asynchronously)."""
    fn()  # warm-up
    rates, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(rates) < 3:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        rates.append(work / (time.perf_counter() - t0))
    return max(rates)


def copy_bandwidth_gb_s(device: str = "cpu", seconds: float = 2.0) -> float:
    """The device's copy bandwidth (GB/s, bytes read plus written): a large tensor copied (256 MB on a CPU, 1 GB
    on a GPU), the best of repeated copies."""
    cuda = torch.device(device).type == "cuda"
    n = 2**28 if cuda else 2**26
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    sync = torch.cuda.synchronize if cuda else lambda: None
    return _best_rate(lambda: dst.copy_(src), 2 * n * 4 / 1e9, seconds, sync)


def machine_peaks(seconds: float = 2.0) -> dict[str, float]:
    """This machine's fp32 matmul rate (GFLOP/s, 1024 x 1024 products) and copy bandwidth (GB/s,
    `copy_bandwidth_gb_s`), each the best of repeated timings over about `seconds`."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return {"peak_gflop_s": _best_rate(lambda: a @ b, 2 * 1024**3 / 1e9, seconds),
            "bandwidth_gb_s": copy_bandwidth_gb_s("cpu", seconds)}


def roofline_s(gflop: float, weight_gb: float, peaks: dict[str, float]) -> float:
    """A phase's least time: its FLOPs at the peak rate or its bytes at the bandwidth, whichever is longer."""
    return max(gflop / peaks["peak_gflop_s"], weight_gb / peaks["bandwidth_gb_s"])
