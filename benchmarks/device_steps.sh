# Sourced by the gpu_issue*.sh device scripts, after they set `out` (their OUT_DIR):
#   step NAME SECONDS COMMAND...   runs COMMAND with a time limit, logs to $out/NAME.log, adds
#                                  "NAME: rc=… in … s; <its last line>" to `summary` and $out/steps.txt
#   archive                        with ARCHIVE set, packs $out into that .tgz (step does it after every
#                                  step: a lease call returns only a few files of $OUT, so point OUT_DIR
#                                  elsewhere and ARCHIVE into $OUT; what a killed run leaves behind)
summary=()

step() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    summary+=("$name: rc=$rc in $((SECONDS - start)) s; $(tail -1 "$out/$name.log" | cut -c1-200)")
    printf '%s\n' "${summary[@]}" > "$out/steps.txt"
    archive
}

archive() {
    [ -z "${ARCHIVE:-}" ] || tar czf "$ARCHIVE" -C "$(dirname "$out")" "$(basename "$out")"
}
