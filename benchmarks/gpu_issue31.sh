#!/usr/bin/env bash
# Issue #31's device run (run once, on purpose, on an H100; under 5 minutes):
#     [BENCHES="plain spec5"] [TESTS_S=180] [ARCHIVE=$OUT/i31.tgz] bash benchmarks/gpu_issue31.sh [OUT_DIR]
# 1. builds the Cython modules in place (benchmarks/device_build_cython.py), 2. runs the speculative GPU
# tests (packages/deepinfer-engine/tests/test_spec_graphs_gpu.py: no eager kernel launch in a
# speculative decode step; greedy = plain greedy with ZOS on and off under graphs, V4 and V4.1; and
# test_cuda_graphs.py), 3. `deepinfer bench` on the embedded model, plain against
# --num-speculative-tokens 5 (varlen verify, the default) and 5 with --no-varlen-verify, one request at a
# time, and 4. writes OUT_DIR/summary.json (per run: mean / p50 TPOT, output tokens/s, tokens per verify
# step; TPOT over plain; the test counts). Logs: OUT_DIR/<step>.log; each bench's JSON: OUT_DIR/bench_*.json.
set -u
out=${1:-${OUT:?usage: gpu_issue31.sh OUT_DIR (or set OUT)}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
[ -f .device/activate.sh ] && source .device/activate.sh
source benchmarks/device_env.sh
export PYTHONUNBUFFERED=1 DEEPINFER_VARLEN_PROFILE_CACHE="$out/varlen_profile.json"
source benchmarks/device_steps.sh

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
step cython 60 python3 benchmarks/device_build_cython.py
step tests "${TESTS_S:-180}" python3 -m pytest -q -rA -p no:cacheprovider -p no:warnings --tb=short -m gpu \
    packages/deepinfer-engine/tests/test_spec_graphs_gpu.py packages/deepinfer-engine/tests/test_cuda_graphs.py
grep -hE "^(PASSED|FAILED|ERROR)" "$out/tests.log" | cut -c1-220

bench() {   # bench NAME [FLAGS...]: the issue's workload on the embedded model
    local name=$1
    shift
    step "bench_$name" 80 python3 -m deepinfer.engine.cli bench --device cuda --dtype bfloat16 --num-prompts 8 \
        --max-concurrency 1 --input-len 64 --output-len 128 --num-warmup 4 --output-json "$out/bench_$name.json" "$@"
}
benches=" ${BENCHES:-plain spec5 spec5_fixed} "      # BENCHES: which of the three to run (device time is scarce)
[[ $benches == *" plain "* ]] && bench plain
[[ $benches == *" spec5 "* ]] && bench spec5 --num-speculative-tokens 5
[[ $benches == *" spec5_fixed "* ]] && bench spec5_fixed --num-speculative-tokens 5 --no-varlen-verify

python3 - "$out" <<'PY'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
runs = {}
for name in ("plain", "spec5", "spec5_fixed"):
    path = out / f"bench_{name}.json"
    if not path.exists():
        runs[name] = None
        continue
    r = json.loads(path.read_text())
    runs[name] = {key: r.get(key) for key in ("mean_tpot_ms", "p50_tpot_ms", "output_tokens_per_s",
                                              "p50_decode_step_ms", "spec_mean_accepted_length")}
plain = (runs.get("plain") or {}).get("mean_tpot_ms")
for name in ("spec5", "spec5_fixed"):
    run = runs.get(name)
    if run and plain and run.get("mean_tpot_ms"):
        run["tpot_over_plain"] = round(run["mean_tpot_ms"] / plain, 3)
log = (out / "tests.log").read_text() if (out / "tests.log").exists() else ""
tests = {kind: len(re.findall(rf"^{kind} ", log, re.M)) for kind in ("PASSED", "FAILED", "ERROR")}
steps = (out / "steps.txt").read_text().splitlines() if (out / "steps.txt").exists() else []
summary = {"gpu": (out / "gpu.txt").read_text().strip(), "tests": tests, "runs": runs, "steps": steps}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary))
PY
printf '%s\n' "${summary[@]}"
archive
