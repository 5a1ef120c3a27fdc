"""What training on several processes takes, in one place, so the loop reads as if there were one: this
process's share of a step's problems, gathers that show every process the whole batch, batch-wide loss
normalisers, the same decision on every process, and what each engine needs (gradient sync only on a
micro-batch that ends an update, DeepSpeed's backward, whole weights for generation under ZeRO-3/FSDP2).
With one process every function here is the identity or a no-op.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
from accelerate.utils import gather_object


def check_launch(accelerator, cfg) -> None:
    """Refuse a launch that cannot be what the user asked for: several processes started (WORLD_SIZE) but
    accelerate sees one, which would run independent copies of the job into one --out-dir; FSDP1; a batch
    that does not split into whole groups and equal micro-batches per process."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    world = accelerator.num_processes
    if launched > 1 and world == 1:
        raise SystemExit(f"{launched} processes were launched (WORLD_SIZE={launched}) but accelerate runs this one "
                         "alone, so each would train its own copy into --out-dir. On GPUs use accelerate launch "
                         "with a config from configs/; on CPU pass --cpu (torchrun --nproc_per_node N lanpo.py --cpu)")
    if getattr(accelerator.state, "fsdp_plugin", None) is not None and not accelerator.is_fsdp2:
        raise SystemExit("FSDP1 is not supported: use FSDP2 (fsdp_version: 2 in the accelerate config, as in "
                         "configs/fsdp.yaml)")
    if cfg.batch_problems % world:
        raise SystemExit(f"--batch-problems {cfg.batch_problems} must be a multiple of the {world} processes "
                         "(each process takes whole groups)")
    if (cfg.batch_problems // world * cfg.group_size) % cfg.micro_batch:
        raise SystemExit(f"--micro-batch {cfg.micro_batch} does not divide the "
                         f"{cfg.batch_problems // world * cfg.group_size} rollouts of each of the {world} processes")
    if cfg.drop_zero_adv_groups and world > 1:
        raise SystemExit("--drop-zero-adv-groups runs in one process only: processes with different numbers of "
                         "micro-batches would stall each other's gradient synchronisation")


def my_share(items: list, accelerator) -> list:
    """This process's contiguous slice of a list that every process holds whole (rank order)."""
    per = len(items) // accelerator.num_processes
    return items[accelerator.process_index * per:(accelerator.process_index + 1) * per]


def gather(items: list) -> list:
    """Every process's items, concatenated in rank order, on every process."""
    return gather_object(items)


def on_any_process(flag: bool) -> bool:
    """True on every process when it is true on one: the same branch everywhere (collective forwards)."""
    return any(gather_object([flag]))


def totals(local: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(sum over processes, largest value on one process) of each count."""
    every = gather_object([local])
    return ({k: sum(c[k] for c in every) for k in local}, {k: max(c[k] for c in every) for k in local})


def mean_over_processes(stats: dict[str, float]) -> dict[str, float]:
    """Each statistic averaged over the processes that measured it (a no-op with one)."""
    every = gather_object([stats])
    keys = dict.fromkeys(k for s in every for k in s)
    return {k: float(np.mean([s[k] for s in every if k in s])) for k in keys}


@contextlib.contextmanager
def gathered_for_generation(model, accelerator):
    """Full parameters for the forwards outside the update (generate, relevance, embeddings), so that
    they make no collective calls and processes may run different numbers of them. ZeRO-3: gathered from
    their shards for the duration (as TRL does); FSDP2: every layer unsharded once and kept so (as its
    docs suggest for evaluation). Either costs one full copy of the weights per GPU for that time; under
    DDP and ZeRO-2 the weights are whole already. Every process must enter it (the gathering is collective)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.zero_stage == 3:
        import deepspeed

        # ZeRO-3's per-module hooks would still make a collective check at the start of every forward:
        # they come off for the duration and are registered again after (as TRL does)
        hooks = model.optimizer.parameter_offload
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            hooks._remove_module_hooks()
            try:
                yield
            finally:
                hooks.forward_hooks, hooks.backward_hooks = [], []
                hooks.setup_zero_stage3_hooks()
    elif accelerator.is_fsdp2:
        from torch.distributed.fsdp import FSDPModule

        shards = [m for m in model.modules() if isinstance(m, FSDPModule)]
        model.set_reshard_after_forward(False)
        for m in shards:
            m.unshard()
        try:
            yield
        finally:
            for m in shards:
                m.reshard()
            model.set_reshard_after_forward(accelerator.state.fsdp_plugin.reshard_after_forward)
    else:
        yield


@contextlib.contextmanager
def micro_batch(accelerator, model, last: bool):
    """One forward/backward of an update that accumulates over several. Gradients are reduced across
    processes only on the last (DDP and FSDP skip the sync before it), and DeepSpeed, which clips and
    steps inside backward(), steps only there: accelerate passes it sync_gradients as the boundary."""
    accelerator.sync_gradients = last
    with contextlib.nullcontext() if last else accelerator.no_sync(model):
        yield


def backward(accelerator, loss: torch.Tensor) -> None:
    """loss.backward() through accelerate. lanpo's losses are normalised over the whole batch already, so
    DeepSpeed must not divide them again by its gradient_accumulation_steps."""
    extra = {"scale_wrt_gas": False} if accelerator.state.deepspeed_plugin is not None else {}
    accelerator.backward(loss, **extra)
