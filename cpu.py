"""CPU-only speed-ups, applied in one place (`speed_up`) by training, evaluation and the benches: glibc's malloc
told to keep the memory a step frees (`keep_freed_host_memory`; `return_freed_host_memory` under
`--cpu-host-memory return`), linear layers that compute few-row no-grad products as W·xᵀ (`RowsFirstLinear`),
and a bf16 LM head that reads its input contiguous (`contiguous_lm_head`). None changes what is computed beyond
float summation order; GPU runs take none. `native_bf16` says whether the CPU computes bf16 in hardware (what
--dtype auto reads).
"""

from __future__ import annotations

import torch


def speed_up(model=None, rows_first: bool = True, host_memory: str = "keep") -> bool:
    """The process's malloc settings (host_memory: keep or trim, `keep_freed_host_memory`; return,
    `return_freed_host_memory`), and (with a model and rows_first) its rows-first linear layers; returns
    whether malloc took the settings (glibc only). Under trim the caller hands free memory back between phases
    (`trim_freed_host_memory`)."""
    kept = return_freed_host_memory() if host_memory == "return" else keep_freed_host_memory()
    if model is not None:
        contiguous_lm_head(model)
        if rows_first:
            rows_first_linears(model)
    return kept


def contiguous_lm_head(model) -> None:
    """Copy the LM head's input contiguous where it is strided and not fp32. `logits_to_keep` hands the head the
    last positions of each row, a slice that cannot be viewed as 2-D; with a weight that needs no gradient (a
    LoRA run's frozen base, a reference model) torch's CPU linear then runs a batched product that expands the
    weight once per row, in bf16 materialising rows x the weight's bytes. At 8 rows SmolLM2's head took 536 ms
    against 6 ms for the copy and one product, Qwen2.5-Coder-1.5B's 12.3 s against 42 ms (`bench/lm_head_input.py`,
    2026-12-07). Prefills and relevance judgements (one last position a row) pay it in full; update forwards,
    with hundreds of positions a row, little. fp32 keeps its own path, bit for bit (no expansion there).
    Registered once per head."""
    head = model.get_output_embeddings()
    if head is not None and not getattr(head, "contiguous_input", False):
        head.register_forward_pre_hook(_contiguous_low_precision_input)
        head.contiguous_input = True


def _contiguous_low_precision_input(module, args):
    x = args[0]
    return (x.contiguous(), *args[1:]) if x.dtype != torch.float32 and not x.is_contiguous() else None


# CPU feature flags (Linux /proc/cpuinfo) of native bf16 arithmetic, which oneDNN uses for bf16 matmuls:
# x86 AVX512-BF16 (Cooper Lake, Zen 4 and later) and AMX-BF16 (Sapphire Rapids); Arm's BF16 extension
# (Armv8.6: Graviton3, Neoverse V1/N2, Apple M2; "bf16" in the Features line). Without them torch emulates
# bf16 by converting to fp32, which runs slower than fp32 itself.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def native_bf16(cpuinfo: str | None = None) -> str:
    """The first native-bf16 feature flag this CPU reports (NATIVE_BF16_FLAGS), or "" when it has none or
    says nothing (no /proc/cpuinfo: macOS, Windows). `cpuinfo`: that file's text, for tests."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return ""
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in flags), "")


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep the memory a CPU step frees, for the next step; returns whether it could
    (glibc only: not on macOS, musl or Windows).

    By default malloc hands the free top of its heap back to the kernel past a threshold that adapts to
    the blocks freed, so a policy update, which frees and re-allocates hundreds of MB of activations and
    gradients, faults them back in page by page at every step. On the 2-core machine of the README's
    benchmarks the kernel's time exceeded the compute (sys 104 s against user 75 s in six updates). Here:
    no trimming, 1 GB of heap growth at a time, and a fixed 32 MB above which blocks are mapped (and
    returned) on their own. The resident size stays at its peak instead of shrinking between steps."""
    return _mallopt(((M_TRIM_THRESHOLD, -1), (M_TOP_PAD, 2**30), (M_MMAP_THRESHOLD, 32 * 2**20)))  # -1: never trim


def return_freed_host_memory() -> bool:
    """Make glibc's malloc map every block of 1 MB or more on its own, so freeing it returns it to the kernel;
    returns whether it could (glibc only). The resident size follows the live tensors, at the price of
    faulting them in at each allocation (`keep_freed_host_memory`'s trade, the other way round). Under keep,
    blocks under 32 MB come from a heap that is never trimmed, and on a model near the machine's memory the
    resident size can grow step by step: Qwen2.5-Coder-1.5B LoRA LANPO steps went from 10 to 16 GB resident
    between steps, 24 GB at the update's peak, over six steps (docs/evaluation.md)."""
    return _mallopt(((M_MMAP_THRESHOLD, 2**20), (M_TRIM_THRESHOLD, 2**20), (M_TOP_PAD, 0)))


def trim_freed_host_memory() -> bool:
    """Hand the memory malloc holds free back to the kernel now: glibc's malloc_trim(0), which releases the free
    top of each heap and the whole free pages inside it; returns whether it could (glibc only). Under
    --cpu-host-memory trim a run keeps freed memory within a phase (`keep_freed_host_memory`: a phase's
    micro-batches and decoding steps reuse it without faults) and calls this between phases, so the resident
    size between phases follows the live tensors, as under return, with one round of faults a phase instead of
    one per block."""
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt's parameters, glibc's <malloc.h>


def _libc():
    """The C library through ctypes, or None where it cannot be opened."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _mallopt(settings: tuple[tuple[int, int], ...]) -> bool:
    """glibc's mallopt(param, value) for each setting; whether every one took (False without glibc)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return all([mallopt(param, value) == 1 for param, value in settings])


class RowsFirstLinear(torch.nn.Linear):
    """nn.Linear whose no-grad fp32 CPU forward on a few rows (decoding: one token per sequence) computes
    W·xᵀ instead of x·Wᵀ. MKL runs the skinny x·Wᵀ 2-8x slower than the same product the other way round
    (SmolLM2's 49152×576 LM head at 2 rows: 24.6 against 3.6 ms) and a matrix-vector product (one row) at a
    third of a two-column product's speed, so one row is computed beside a zero row. The same dot products,
    summed in another order: outputs agree to float rounding. Training forwards (grad enabled), larger
    batches, other dtypes and devices take nn.Linear's own path, bit for bit."""

    max_rows = 64  # measured crossover: at 256 rows x·Wᵀ is as fast or faster (bench/cpu_matmul.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if (torch.is_grad_enabled() or rows > self.max_rows or x.device.type != "cpu"
                or self.weight.dtype != torch.float32):
            return super().forward(x)
        columns = x.reshape(rows, x.shape[-1])
        if rows == 1:
            columns = torch.cat([columns, torch.zeros_like(columns)])
        y = (self.weight @ columns.T)[:, :rows].T.contiguous()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def rows_first_linears(model) -> int:
    """Make every plain nn.Linear of `model` a RowsFirstLinear (faster CPU decoding, see there); the weights
    and everything that refers to them stay as they are. Returns how many layers changed."""
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    for m in layers:
        m.__class__ = RowsFirstLinear
    return len(layers)
