"""Seeded tiny-model runs with every training feature on, and their fingerprints (metrics without timing
columns, per-tensor sums of the final weights), recorded in tests/golden/ before a refactor of the loop and
compared after it by tests/test_golden.py: a behaviour change shows as a changed number.

    python tests/golden_runs.py      # re-record (only when a change of behaviour is intended; say so in the commit)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

COMMON = ["--steps", "4", "--batch-problems", "2", "--group-size", "4", "--micro-batch", "4", "--max-new-tokens", "8",
          "--synthetic-size", "3", "--eval-size", "4", "--eval-every", "2", "--report-to", "none", "--lr", "1e-3",
          "--relevance-threshold", "0", "--abstract-max-tokens", "8", "--attempt-tokens", "16",
          "--no-final-checkpoint"]
RUNS = {  # name -> flags: between them, every branch of the training step
    "context-kl-epochs": ["--feedback", "both", "--beta", "0.04", "--ppo-epochs", "2", "--lr-schedule", "linear",
                          "--warmup-steps", "1", "--self-distill-coef", "0.1", "--feedback-model-coef", "0.1"],
    "distill-drop": ["--feedback", "both", "--feedback-grad", "distill", "--drop-zero-adv-groups",
                     "--loss-type", "dapo", "--adv-scale", "batch"],
    "strip-reflect": ["--feedback", "reflect", "--feedback-grad", "strip", "--loss-type", "dr_grpo",
                    "--self-distill-coef", "0.1", "--self-distill-div", "jsd", "--eps-high", "0.28"],
    # gamma between the tiny model's two relevance scores in this run (0.5321 kept at step 2, 0.5312 not at step 3)
    "relevance-any": ["--feedback", "both", "--relevance-threshold", "0.5316", "--reflect-source", "any",
                      "--reflect-attempts", "2"],
}


def fingerprint(model_dir: Path, out_dir: Path, flags: list[str]) -> dict:
    """Run lanpo on the tiny model (rewards by length parity, so every group has signal) and fingerprint it."""
    from conftest import fake_grade, training_metrics
    from safetensors.torch import load_file

    import abstract
    import config
    import lanpo
    import math_grader

    judged = []  # every relevance request the run scored, with its score

    def recorded_relevance_scores(model, tokenizer, pairs, *args, **kwargs):
        scores = real_scores(model, tokenizer, pairs, *args, **kwargs)
        judged.extend(zip(pairs, scores))
        return scores

    real_grade, math_grader.grade = math_grader.grade, fake_grade
    real_scores, abstract.relevance_scores = abstract.relevance_scores, recorded_relevance_scores
    try:
        pool = lanpo.main(config.parse_config(["--model", str(model_dir), "--out-dir", str(out_dir), *COMMON, *flags]))
    finally:
        math_grader.grade, abstract.relevance_scores = real_grade, real_scores
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    weights = load_file(str(out_dir / "final" / "model.safetensors"))
    return {"metrics": training_metrics(out_dir),
            "weights": {k: [v.double().sum().item(), v.double().abs().sum().item()]
                        for k, v in sorted(weights.items())},
            "pool": [[t.problem_id, t.kind, t.context, t.response, t.reward, t.step]
                     for ts in pool.trials.values() for t in ts],
            "relevance": [list(pair) for pair in judged]}


if __name__ == "__main__":
    import tempfile

    from conftest import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model")
        for name, flags in RUNS.items():
            print(name, flush=True)
            (HERE / "golden" / f"{name}.json").write_text(
                json.dumps(fingerprint(model_dir, Path(tmp) / name, flags), indent=1) + "\n")
