#!/usr/bin/env bash
# The GPU test suite: the kernel tests (against their twins), the CUDA-graph and sampler tests of the
# engine, and every `gpu`-marked test of deepinfer-model, deepinfer-engine and integration_tests.
# Tests not marked `gpu_heavy` run first in SHARDS concurrent pytest processes on one GPU (Triton's
# compilation is CPU-bound, and the device has 16 cores); then the `gpu_heavy` ones (tens of GB of
# GPU memory each) one at a time, in one process, so that none of them meets another's memory.
# Usage, on the device after `source .device/activate.sh && source benchmarks/device_env.sh`:
#     bash tools/gpu_tests.sh LOG_DIR [more test paths]
# Logs: LOG_DIR/shard.*.log and LOG_DIR/heavy.log; the last lines printed are each one's summary.
set -u
log_dir=${1:?usage: tools/gpu_tests.sh LOG_DIR [more test paths]}
shift
mkdir -p "$log_dir"
all=(packages/deepinfer-kernels/tests packages/deepinfer-engine/tests/test_cuda_graphs.py
     packages/deepinfer-engine/tests/test_sampler.py "$@")
marked=(packages/deepinfer-model/tests packages/deepinfer-engine/tests integration_tests)

collect() {   # collect MARK_EXPR_FOR_ALL MARK_EXPR_FOR_MARKED: test ids, one a line, sorted, unique
    { python3 -m pytest --collect-only -q -o addopts="--import-mode=importlib" -p no:cacheprovider -m "$1" \
          "${all[@]}" 2>/dev/null
      python3 -m pytest --collect-only -q -o addopts="--import-mode=importlib" -p no:cacheprovider -m "$2" \
          "${marked[@]}" 2>/dev/null; } | grep '::' | sort -u
}

light=$(mktemp)
heavy=$(mktemp)
collect "not gpu_heavy" "gpu and not gpu_heavy" > "$light"
collect "gpu_heavy" "gpu_heavy" > "$heavy"
echo "collected $(wc -l < "$light") tests into ${SHARDS:-6} shards, then $(wc -l < "$heavy") gpu_heavy ones"
[ -s "$light" ] || exit 1
split -n "r/${SHARDS:-6}" "$light" "$light.shard."
for shard in "$light".shard.*; do
    (mapfile -t tests < "$shard"
     python3 -m pytest -p no:cacheprovider -p no:warnings --tb=short "${tests[@]}" \
         > "$log_dir/shard.${shard##*.}.log" 2>&1) &
done
wait
if [ -s "$heavy" ]; then
    mapfile -t tests < "$heavy"
    python3 -m pytest -p no:cacheprovider -p no:warnings --tb=short "${tests[@]}" > "$log_dir/heavy.log" 2>&1
fi
status=0
for log in "$log_dir"/shard.*.log "$log_dir"/heavy.log; do
    [ -f "$log" ] || continue
    summary=$(tail -1 "$log")
    echo "$(basename "$log"): $summary"
    grep -E "^(FAILED|ERROR)" "$log" | cut -c1-200
    [[ $summary == *failed* || $summary == *error* ]] && status=1
done
exit $status
