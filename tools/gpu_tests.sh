#!/usr/bin/env bash
# The GPU test suite (kernels against their twins, CUDA-graph engine tests, the sampler) in SHARDS
# concurrent pytest processes on one GPU: Triton's compilation is CPU-bound, and the device has 16
# cores. Usage, on the device after `source .device/activate.sh && source benchmarks/device_env.sh`:
#     bash tools/gpu_tests.sh LOG_DIR [more test paths]
# Each shard's log goes to LOG_DIR/shard.*.log; the last lines printed are each shard's summary.
set -u
log_dir=${1:?usage: tools/gpu_tests.sh LOG_DIR [more test paths]}
shift
mkdir -p "$log_dir"
ids=$(mktemp)
python3 -m pytest --collect-only -q -o addopts="" -p no:cacheprovider packages/deepinfer-kernels/tests \
    packages/deepinfer-engine/tests/test_cuda_graphs.py packages/deepinfer-engine/tests/test_sampler.py "$@" \
    2>/dev/null | grep '::' > "$ids"
echo "collected $(wc -l < "$ids") tests into ${SHARDS:-6} shards"
[ -s "$ids" ] || exit 1
split -n "r/${SHARDS:-6}" "$ids" "$ids.shard."
for shard in "$ids".shard.*; do
    (mapfile -t tests < "$shard"
     python3 -m pytest -p no:cacheprovider -p no:warnings --tb=short "${tests[@]}" \
         > "$log_dir/shard.${shard##*.}.log" 2>&1) &
done
wait
status=0
for log in "$log_dir"/shard.*.log; do
    summary=$(tail -1 "$log")
    echo "$(basename "$log"): $summary"
    grep -E "^(FAILED|ERROR)" "$log" | cut -c1-200
    [[ $summary == *failed* || $summary == *error* ]] && status=1
done
exit $status
