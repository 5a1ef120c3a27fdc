"""The model's work in a lanpo.py run: the FLOPs of every forward (and backward) of the policy, by the phase of
the step that made it. bench/lanpo_overhead.py runs its arms through this file, so that next to each arm's
seconds it can say how much of LANPO's extra time is extra work, which no implementation removes without
changing the method, and how much is time per unit of work (overhead, or hardware that runs small batches
slowly).

    python bench/work.py <lanpo.py flags>       # lanpo.py as usual; each metrics line gains work/* fields

Per step, each phase p (sampling, principles, relevance, retrieval, update, eval, other) adds `work/p_gflop`
(padding included, as computed), `work/p_padding_gflop` (the part spent on padding: mask-0 positions, and decoding
rows that have already stopped), `work/p_tokens` (token positions computed) and `work/p_decode_rows` (forwards of
one new token per row: decoding) and `work/p_weight_gb` (the weights' bytes each forward must read: once a forward,
x3 under grad, where the backward reads them again and writes their gradient; activations, KV cache and optimizer
state left out, so a lower bound). `work/update_padding_gflop_prompts` is the part of the update's padding in
forward (2) of the prompt prefix tree (`forwards.shared_prompt_logits`: distinct prompts padded to the longest of
their column range); its name does not end in _gflop, so that sums over the phases' keys do not count it again. A
forward of T new tokens over K key columns (the attention mask's width, padding and cache included, as computed)
counts 2 x (the parameters of the decoder layers) per token, 4 x layers x hidden x K per token for attention, and 2
x vocab x hidden per position the LM head computes; x3 under grad (the backward costs twice the forward). Layer
norms, rotary embeddings and the softmax are left out (under 1 % of a forward at these sizes). Padding's share of a
forward is counted as its share of the positions.
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import config  # noqa: E402
import lanpo  # noqa: E402
import rundir  # noqa: E402

# (file, function) on the stack -> phase; the innermost match wins (relevance runs inside lessons_for)
PHASES = {("lanpo.py", "sample"): "sampling", ("update.py", "policy_update"): "update",
          ("lanpo.py", "evaluate_accuracy"): "eval", ("abstract.py", "relevance_scores"): "relevance",
          ("abstract.py", "lessons_for"): "principles", ("abstract.py", "embed"): "retrieval"}
counts: collections.Counter = collections.Counter()


def phase_of_caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        phase = PHASES.get((os.path.basename(frame.f_code.co_filename), frame.f_code.co_name))
        if phase is not None:
            return phase
        frame = frame.f_back
    return "other"


def counter(model, stop_ids: set[int]):
    """A forward pre-hook for `model` that adds each forward's FLOPs to `counts` under its phase. A position is
    padding if its attention mask is 0, or if it feeds a stop token (EOS, pad) to a decoding step: generate()
    keeps decoding rows that have finished until the whole batch has (a prompt may hold a stop token, so
    only generate()'s decoding steps are checked)."""
    stop = torch.tensor(sorted(stop_ids))
    cfg = model.config
    layers = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name)
    head = cfg.vocab_size * cfg.hidden_size
    attention = 4 * cfg.num_hidden_layers * cfg.hidden_size
    weight_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"][..., 0]
        rows, new = ids.shape
        mask = kwargs.get("attention_mask")
        keys = mask.shape[-1] if mask is not None else new
        keep = kwargs.get("logits_to_keep", 0)
        head_rows = rows * (new if not isinstance(keep, int) or keep == 0 else min(keep, new))
        flops = (rows * new * (2 * layers + attention * keys) + 2 * head * head_rows) * (
            3 if torch.is_grad_enabled() else 1)
        real = mask[:, -new:].bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
        phase = phase_of_caller()
        if new == 1 and phase in ("sampling", "principles", "eval"):  # a decoding step of generate()
            real = real & ~torch.isin(ids, stop.to(ids.device))
        counts[f"{phase}_gflop"] += flops / 1e9
        padding = flops * (1 - int(real.sum()) / (rows * new)) / 1e9
        counts[f"{phase}_padding_gflop"] += padding
        # forward (2) keeps one logit a row and continues the prefix's cache; so does forward (3) for a group
        # whose completions are all one token long (rare), which is counted here too
        if phase == "update" and keep == 1 and keys > new:
            counts["update_padding_gflop_prompts"] += padding
        counts[f"{phase}_tokens"] += rows * new
        counts[f"{phase}_weight_gb"] += weight_gb * (3 if torch.is_grad_enabled() else 1)
        if new == 1:
            counts[f"{phase}_decode_rows"] += rows
    return count


def main(argv: list[str] | None = None) -> None:
    """lanpo.py's main with the counter on the policy and the counts in each metrics line (then unpatched)."""
    setup, append_metrics = lanpo.setup, rundir.append_metrics

    def counted_setup(cfg):
        run = setup(cfg)
        stop_ids = {*run.eos_ids, run.tokenizer.pad_token_id}
        run.policy.register_forward_pre_hook(counter(run.policy, stop_ids), with_kwargs=True)
        return run

    def counted_append_metrics(path, record):  # the step's line, written after its evaluation
        append_metrics(path, {**record, **{f"work/{k}": float(v) for k, v in counts.items()}})
        counts.clear()

    lanpo.setup, rundir.append_metrics = counted_setup, counted_append_metrics
    try:
        lanpo.main(config.parse_config(argv))
    finally:
        lanpo.setup, rundir.append_metrics = setup, append_metrics
        counts.clear()


if __name__ == "__main__":
    main()
