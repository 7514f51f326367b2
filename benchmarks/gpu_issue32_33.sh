#!/usr/bin/env bash
# Issues #32 and #33's device run (one lease call, under 10 minutes, on an H100 or H200):
#     [PD_S=150] [PREFIX_S=240] [SKIP_HOST=1] [ARCHIVE=$OUT/p.tgz] bash benchmarks/gpu_issue32_33.sh OUT_DIR
# 1. builds the Cython modules in place; 2. issue #33: benchmarks/pd_pair.py on CUDA (one server, then a
# prefill/decode pair sharing the GPU), which needs fastapi / uvicorn / httpx: the device has none, so they
# are installed from .device/wheels312 (cp312 wheels carried with the call) into a scratch folder first;
# 3. issue #32: benchmarks/prefix_cache.py on the 8-layer V4-Flash-shaped dummy model with FP8 experts,
# 64 chats x 6 turns, caching on vs off (the issue's workload); 4. unless SKIP_HOST, the host tier of #32
# (16 chats at once, a 600-block device cache). Each step has a time limit; logs and JSON: OUT_DIR.
set -u
out=${1:?usage: gpu_issue32_33.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
[ -f .device/activate.sh ] && source .device/activate.sh
source benchmarks/device_env.sh
export PYTHONUNBUFFERED=1
source benchmarks/device_steps.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
step cython 60 python3 benchmarks/device_build_cython.py
flash=(--flash-layers 8 --device cuda --expert-dtype fp8 --conversations 64 --turns 6 --system-tokens 2048
       --user-tokens 128 --output-tokens 64 --max-model-len 4096 --repeats 1)
extra=/tmp/deepinfer-serve-deps
if [ -d .device/wheels312 ]; then
    python3 -m pip install -q --no-index --no-deps --target "$extra" .device/wheels312/*.whl > "$out/wheels.log" 2>&1
    export PYTHONPATH="$PYTHONPATH:$extra"
fi
step pd_pair "${PD_S:-150}" python3 benchmarks/pd_pair.py --device cuda --output-json "$out/pd_pair.json"
step prefix "${PREFIX_S:-240}" python3 benchmarks/prefix_cache.py "${flash[@]}" --out "$out/prefix"
if [ -z "${SKIP_HOST:-}" ]; then
    step prefix_host 120 python3 benchmarks/prefix_cache.py "${flash[@]}" --max-num-seqs 16 --modes on,host \
        --host-mode-kv-blocks 600 --out "$out/prefix_host"
fi
# the figures, into the call's output (it returns only the end of the output and a few files)
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("prefix*/*.json")):
    r = json.loads(path.read_text())
    print(path.parent.name, {k: r.get(k) for k in ("same_tokens", "ttft_later_turns_speedup", "ttft_turn1_ratio",
                                                   "prefill_tokens_ratio", "prefill_tokens_on", "prefill_tokens_off")})
if (out / "pd_pair.json").exists():
    r = json.loads((out / "pd_pair.json").read_text())
    print("pd_pair", json.dumps({side: {k: r[side].get(k) for k in ("decode", "long")} for side in ("one_engine", "pair")
                                 if side in r}))
PY
printf '%s\n' "${summary[@]}"
archive
