#!/usr/bin/env bash
# DeepInfer developer entry point. Sets up .venv on first use (CPU torch, every package editable),
# then runs one job:
#   ./dev.sh generate "def fibonacci("   generate text with the embedded default model
#   ./dev.sh test                        lint (ruff, import-linter, mypy, tools/code_checks.py: import
#                                        cycles and complexity) + the whole CPU test suite (the Triton
#                                        kernels' tests under Triton's CPU interpreter beside it)
#   ./dev.sh bench ...                   `deepinfer bench` with the given arguments
#   ./dev.sh shell                       a shell with .venv active
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
VENV=.venv
PACKAGES=(kernels model cache sched spec eplb engine)
TORCH_SPEC=${DEEPINFER_TORCH_SPEC:-torch==2.13.0}   # CPU build; an unpinned torch pulls CUDA wheels
TOOLS=(nox ruff import-linter mypy==2.4.1 radon==6.0.1)   # lint tools; the noxfile pins the same mypy and radon

setup() {
  local stamp="$VENV/.deepinfer-stamp" want
  want=$( (echo "${TOOLS[*]}"; cat packages/*/pyproject.toml packages/*/hatch_build.py \
              $(find packages -name '*.pyx' -o -name '*.pxd' | sort)) 2>/dev/null | sha1sum | cut -c1-16)
  if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then return; fi
  [[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
  local pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" "$TORCH_SPEC"
  "${pip[@]}" "${TOOLS[@]}"
  local args=()
  for p in "${PACKAGES[@]}"; do args+=(-e "packages/deepinfer-$p[test]"); done
  "${pip[@]}" "${args[@]}"
  echo "$want" > "$stamp"
}

job=${1:-help}; shift || true
case "$job" in
  generate) setup; exec "$VENV/bin/deepinfer" generate "$@" ;;
  bench)    setup; exec "$VENV/bin/deepinfer" bench "$@" ;;
  test)
    setup
    "$VENV/bin/ruff" check .
    "$VENV/bin/lint-imports"
    "$VENV/bin/python" tools/code_checks.py   # no import cycle, no function over complexity 20
    "$VENV/bin/mypy"                          # pyproject.toml [tool.mypy]; incremental cache in .mypy_cache
    # Two busy processes on two cores, each with one torch thread: the Triton-interpreter pass, then the
    # kernel / model / integration tests (SIDE), beside the engine's and the other packages' tests (MAIN);
    # the halves take about as long (the interpreter pass alone was half the main suite, leaving a core idle).
    side=(packages/deepinfer-kernels/tests packages/deepinfer-model/tests integration_tests)
    main=(packages/deepinfer-engine/tests packages/deepinfer-sched/tests packages/deepinfer-cache/tests
          packages/deepinfer-spec/tests packages/deepinfer-eplb/tests)
    [[ $(ls -d packages/*/tests | wc -l) -eq $(( ${#side[@]} + ${#main[@]} - 1 )) ]] || {
        echo "dev.sh test: a package's tests are in neither half (update SIDE / MAIN)"; exit 1; }
    # the re-packed MXFP4 decoder's exactness (its file's other decoders take ~80 s more)
    mxfp4_packed=()
    for t in "test_every_code_at_every_scale_byte_decodes_exactly[packed]" \
             "test_random_rows_decode_exactly_past_a_partial_tile[packed]" \
             "test_a_token_gets_the_same_bits_alone_and_in_a_batch[packed]" \
             "test_experts_through_each_decoder_match_the_reference[packed-3-16-160-96]"; do
        mxfp4_packed+=("packages/deepinfer-kernels/tests/test_mxfp4_decode.py::$t")
    done
    interp_log=$(mktemp)
    side_log=$(mktemp)
    (TRITON_INTERPRET=1 OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest -rA -p no:cacheprovider \
        -W ignore::DeprecationWarning \
        packages/deepinfer-kernels/tests/test_triton_ops.py packages/deepinfer-kernels/tests/test_triton_v41.py \
        packages/deepinfer-kernels/tests/test_triton_moe_grouped.py packages/deepinfer-model/tests/test_v41_kernels.py \
        packages/deepinfer-model/tests/test_moe_grouped_prefill.py integration_tests/test_triton_path.py \
        "${mxfp4_packed[@]}" > "$interp_log" 2>&1 || echo "interp" >> "$side_log.failed"
     OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest "${side[@]}" "$@" > "$side_log" 2>&1 \
        || echo "side" >> "$side_log.failed") &
    side_job=$!
    status=0
    OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest "${main[@]}" "$@" || status=$?
    wait "$side_job"
    echo "--- kernels, model and integration tests:"
    cat "$side_log"
    if grep -qx side "$side_log.failed" 2>/dev/null; then status=1; fi
    if grep -qx interp "$side_log.failed" 2>/dev/null; then
        cat "$interp_log"; echo "--- the Triton-interpreter pass (TRITON_INTERPRET=1) FAILED"; status=1
    else
        echo "--- the Triton-interpreter pass (TRITON_INTERPRET=1) passed: $(grep -c PASSED "$interp_log") tests"
    fi
    rm -f "$interp_log" "$side_log" "$side_log.failed"
    exit "$status" ;;
  shell)    setup; exec bash --rcfile <(echo "source $VENV/bin/activate") ;;
  *) sed -n '2,8p' "$0"; exit 2 ;;
esac
