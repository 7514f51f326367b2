#!/usr/bin/env bash
# Issue #29's device runs, one phase per lease call (run on purpose, on the GPU machine, after
# `source .device/activate.sh && source benchmarks/device_env.sh`):
#     bash benchmarks/gpu_issue29.sh probe  OUT_DIR   # the fixed GPU tests, tile sweep, decode FP4
#     bash benchmarks/gpu_issue29.sh final  OUT_DIR   # decode per expert dtype at 1/8/32/256, the GPU suite
#     bash benchmarks/gpu_issue29.sh kernel OUT_DIR   # the `packed` MXFP4 decoder: first its bit-exactness probe
#                                                     # (mxfp4_packed_probe.py), its GPU tests, the sweep
#                                                     # against dot_scaled / asm / FP8, decode FP4 with it
# Each step's log goes to OUT_DIR (with ARCHIVE=path.tgz set, packed there after every step); a step
# that fails or runs out of time does not stop the next.
# A one-line summary per step is printed last (the lease returns only the end of the output).
set -u
phase=${1:?usage: gpu_issue29.sh probe|final|kernel OUT_DIR}
out=${2:?usage: gpu_issue29.sh probe|final|kernel OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
source benchmarks/device_steps.sh        # step / archive; steps.txt in OUT_DIR

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
decode() {   # decode DTYPE [MXFP4_DECODER]: 8 V4-Flash layers at batch 1/8/32/256, graph step against the roofline
    local dtype=$1 decoder=${2:-}
    local args=() name=decode_$dtype${2:+_$2}
    [ "$dtype" != bf16 ] && args=(--expert-dtype "$dtype")
    [ -n "$decoder" ] && args+=(--mxfp4-decode "$decoder")
    step "$name" 100 python3 benchmarks/v4_decode_gpu.py --layers 8 --context 1024 --steps 20 \
        --hf-batches "" --batches 1,8,32,256 "${args[@]}" --out "$out/$name.json"
    python3 -c "import json, sys; rows = json.load(open(sys.argv[1]))['ours']
print(sys.argv[2], ' '.join(f\"b{r['batch']}: {r.get('graph_ms', 0):.3f} ms {r.get('step_over_roofline', 0):.2f}x\"
                            for r in rows if 'batch' in r))" "$out/$name.json" "$name" 2>&1 | tail -1
}

if [ "$phase" = probe ]; then
    step tests 110 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short -m gpu \
        packages/deepinfer-kernels/tests/test_triton_moe_grouped.py integration_tests/test_v41_generate.py \
        packages/deepinfer-engine/tests/test_cuda_graphs.py packages/deepinfer-kernels/tests/test_mxfp4_decode.py
    grep -hE "^(FAILED|ERROR)" "$out/tests.log" | cut -c1-220
    step sweep 90 python3 benchmarks/moe_tile_sweep.py --shape v4 --formats fp8,mxfp4 --decodes dot_scaled,asm \
        --batches 1,8,32,256 --block-n 64,128 --block-k 128,256 --warps 4,8 --stages 3 --out "$out/sweep.json"
    tail -13 "$out/sweep.log"
    decode fp4
    step kernel_tests 50 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short -m "gpu and not gpu_heavy" \
        packages/deepinfer-kernels/tests/test_triton_ops.py -k "mxfp4 or fp8 or moe"
    grep -hE "^(FAILED|ERROR)" "$out/kernel_tests.log" | cut -c1-220
elif [ "$phase" = kernel ]; then
    # first: are the packed decoder's weights bit-exact on this card (issue #29: they were not on the H100)?
    step packed_probe 60 python3 benchmarks/mxfp4_packed_probe.py
    grep -vE "^ (got|want) " "$out/packed_probe.log" | tail -8
    grep -qx "packed probe: PASS" "$out/packed_probe.log" || sed -n '2,7p' "$out/packed_probe.log"
    step kernel_tests 60 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short -m gpu \
        packages/deepinfer-kernels/tests/test_mxfp4_decode.py packages/deepinfer-kernels/tests/test_triton_moe_grouped.py \
        -k "(packed or asm or runnable) and not 4096"
    grep -hE "^(FAILED|ERROR)" "$out/kernel_tests.log" | cut -c1-220
    step sweep 100 python3 benchmarks/moe_tile_sweep.py --shape v4 --formats fp8,mxfp4 \
        --decodes dot_scaled,asm,packed --batches 1,8,32,256 --block-n 64,128 --block-k 128,256 --warps 4,8 \
        --stages 3 --out "$out/sweep.json"
    tail -17 "$out/sweep.log"
    decode fp4 packed
    decode fp4                     # the shipped decoder on the same card (last: the first to go if time runs out)
elif [ "$phase" = final ]; then
    for dtype in fp4 fp8 bf16; do decode "$dtype"; done
    step suite 330 bash tools/gpu_tests.sh "$out/suite"
    cat "$out/suite.log"
fi
printf '%s\n' "${summary[@]}"
