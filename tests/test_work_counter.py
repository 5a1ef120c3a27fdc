"""bench/work.py, the FLOP counter behind bench/lanpo_overhead.py's work ratio: its count on a hand-computed
forward, and its attribution of a real run's forwards to the phases of the step."""

import json
import sys

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import work  # noqa: E402


def test_flops_of_a_forward_by_hand(tiny):
    model, tokenizer = tiny
    cfg = model.config
    decoder = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name)
    assert decoder == 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32)  # q, o; k, v (2 of 4 heads); MLP; norms
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])  # one padding position of ten
    per_token = 2 * decoder + 4 * cfg.num_hidden_layers * cfg.hidden_size * 5  # 5 key columns
    forward = 10 * per_token + 2 * cfg.vocab_size * cfg.hidden_size * 2  # the LM head on the last position only
    hook = model.register_forward_pre_hook(work.counter(model, {tokenizer.pad_token_id}), with_kwargs=True)
    try:
        work.counts.clear()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
        assert work.counts["other_gflop"] * 1e9 == pytest.approx(forward)
        assert work.counts["other_padding_gflop"] * 1e9 == pytest.approx(forward / 10)
        assert work.counts["other_tokens"] == 10
        weights = sum(p.numel() for p in model.parameters()) * 4  # fp32: every weight read once a forward
        assert work.counts["other_weight_gb"] * 1e9 == pytest.approx(weights)
        work.counts.clear()
        model(input_ids=ids, attention_mask=mask, logits_to_keep=1)  # under grad: forward and backward
        assert work.counts["other_gflop"] * 1e9 == pytest.approx(3 * forward)
        assert work.counts["other_weight_gb"] * 1e9 == pytest.approx(3 * weights)
    finally:
        hook.remove()
        work.counts.clear()


def test_prompt_padding_of_the_update_is_counted_apart(tiny, monkeypatch):
    import forwards
    model, tokenizer = tiny
    cfg = model.config
    decoder = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name)
    pad = tokenizer.pad_token_id
    # [left pad | prompt | completion]: prompts share 5, 6, 7; after it, forward (2) runs columns 3-4 of both
    # distinct prompts (their last token goes with the completion): 2 real positions for A, 1 for B. B's
    # completion is one token: forward (3) pads too, and that padding is not the prompts'
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 12, 13, 14], [pad, 5, 6, 7, 15, 11, 12, pad, pad]])
    mask = torch.tensor([[1] * 9, [0, 1, 1, 1, 1, 1, 1, 0, 0]])
    forward2 = 2 * 2 * (2 * decoder + 4 * cfg.num_hidden_layers * cfg.hidden_size * 5) \
        + 2 * cfg.vocab_size * cfg.hidden_size * 2  # 2 rows x 2 tokens over 5 key columns; the head on 1 each
    monkeypatch.setattr(work, "phase_of_caller", lambda: "update")
    hook = model.register_forward_pre_hook(work.counter(model, {pad}), with_kwargs=True)
    try:
        work.counts.clear()
        with torch.no_grad():
            forwards.completion_logits(model, ids, mask, 3, share_prompts=True)
        assert work.counts["update_padding_gflop_prompts"] * 1e9 == pytest.approx(forward2 / 4)
        assert work.counts["update_padding_gflop"] > work.counts["update_padding_gflop_prompts"]
        work.counts.clear()
        with torch.no_grad():  # two column ranges: A's first rest token alone, then both: no prompt padding
            forwards.completion_logits(model, ids, mask, 3, share_prompts=True, prompt_chunks=2)
        assert work.counts["update_padding_gflop_prompts"] == 0 and work.counts["update_padding_gflop"] > 0
        work.counts.clear()
        with torch.no_grad():  # one forward over whole rows: no prefix tree, nothing counted apart
            forwards.completion_logits(model, ids, mask, 3)
        assert "update_padding_gflop_prompts" not in work.counts and work.counts["update_padding_gflop"] > 0
    finally:
        hook.remove()
        work.counts.clear()


@pytest.mark.parametrize("feedback", ["none", "both"])
def test_a_runs_work_is_attributed_to_its_phases(tiny_model_dir, tmp_path, graded_by_parity, feedback):
    out = tmp_path / feedback
    work.main(["--model", str(tiny_model_dir), "--out-dir", str(out), "--steps", "2", "--batch-problems", "2",
               "--group-size", "4", "--micro-batch", "4", "--max-new-tokens", "8", "--synthetic-size", "2",
               "--eval-every", "0", "--relevance-threshold", "0.01", "--abstract-max-tokens", "8",
               "--report-to", "none", "--feedback", feedback, "--no-final-checkpoint"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    phases = {key.split("/")[1].rsplit("_", 1)[0] for r in records for key in r if key.endswith("_gflop")}
    if feedback == "none":
        assert phases == {"sampling", "update", "sampling_padding", "update_padding"}
    else:  # step 2 judges the other problem's trials and distils principles from those it keeps
        assert {"relevance", "principles"} <= phases and "other" not in phases
        assert records[1]["work/relevance_tokens"] > 0 and records[1]["principles_made"] == 2
        assert records[1]["work/principles_decode_rows"] >= 2
    for r in records:
        assert r["work/sampling_decode_rows"] >= 8 and r["work/update_gflop"] > 2 * r["work/sampling_gflop"] / 8
    assert not work.counts  # the counter is reset, and lanpo is unpatched after the run
    assert work.lanpo.setup.__name__ == "setup"


def test_every_phase_names_a_function_that_exists():
    """The phases are found by (file, function) on the stack: a function moved to another module would
    silently count its work as "other" (the update's did, when it moved to update.py, until this test)."""
    import re

    for (file, function), phase in work.PHASES.items():
        assert re.search(rf"^\s*def {function}\(", (ROOT / file).read_text(), flags=re.M), (file, function, phase)


def test_the_roofline_takes_the_slower_of_compute_and_bytes():
    import common

    peaks = {"peak_gflop_s": 100.0, "bandwidth_gb_s": 10.0}
    assert common.roofline_s(50.0, 1.0, peaks) == pytest.approx(0.5)   # compute-bound: 50 GFLOP at 100/s
    assert common.roofline_s(10.0, 2.0, peaks) == pytest.approx(0.2)   # bytes-bound: 2 GB at 10 GB/s
    measured = common.machine_peaks(seconds=0.2)
    assert measured["peak_gflop_s"] > 1 and measured["bandwidth_gb_s"] > 0.5  # a real machine's rates, positive
