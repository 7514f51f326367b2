# Source on a machine where the packages cannot be pip-installed (e.g. the lent H200: no network,
# no build tools for our hatchling/Cython builds): puts every package's src/ on PYTHONPATH and gives
# importlib.metadata a version record for each, so `import deepinfer.<name>` works from the tree.
# The Cython modules of deepinfer-cache / deepinfer-sched are not built this way: use only code that
# does not import deepinfer.cache (model, kernels, engine.cuda_graphs, sampler).
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_meta=${TMPDIR:-/tmp}/deepinfer-meta
rm -rf "$_meta" && mkdir -p "$_meta"     # no stale version records
for _pkg in "$_root"/packages/deepinfer-*; do
  _name=$(basename "$_pkg")
  _version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$_pkg/pyproject.toml")
  PYTHONPATH="$_pkg/src${PYTHONPATH:+:$PYTHONPATH}"
  mkdir -p "$_meta/${_name//-/_}-$_version.dist-info"
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$_name" "$_version" \
    > "$_meta/${_name//-/_}-$_version.dist-info/METADATA"
done
export PYTHONPATH="$_meta:$PYTHONPATH"
