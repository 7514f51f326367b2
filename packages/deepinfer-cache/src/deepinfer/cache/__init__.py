"""DeepInfer cache: block and state-slot managers and the KV/state byte layout planner.

`BlockManager` (Cython) hands out paged KV block ids, and through `BlockManager.for_state_slots`
per-sequence state slots, from an array-backed doubly linked free list with a refcount per block;
id 0 is reserved. For prefix caching a block may carry a content hash (`chain_hashes`, a sha256
chain over full blocks of tokens), kept while the block is free until it is handed out again.
`plan_paged_layout` / `plan_state_layout` decide where every paged KV stream and
every per-sequence state region live inside one uint8 buffer each. No torch: the engine allocates
the buffers. Settings are arguments (the slot ratio of `BlockManager.for_state_slots` included); the
one environment variable read here is DEEPINFER_CACHE_PURE_PYTHON=1, at import, which lets a source
tree whose Cython module was never built (a machine without a compiler or without Cython) run the
pure-Python twin — same behaviour, slower — instead of failing.
"""

import os
from importlib.metadata import PackageNotFoundError, version

try:
    from ._block_pool import BlockManager
except ImportError as error:
    if os.environ.get("DEEPINFER_CACHE_PURE_PYTHON") != "1":
        raise ImportError(
            "deepinfer.cache._block_pool (Cython) is not built; install the package with "
            "`pip install packages/deepinfer-cache` or `pip install -e packages/deepinfer-cache` "
            "(or set DEEPINFER_CACHE_PURE_PYTHON=1 to run the slower pure-Python twin)"
        ) from error
    from ._pure.block_pool import BlockManager
from .layout import (
    PagedLayout,
    PagedStream,
    RegionPlacement,
    StateLayout,
    StateRegion,
    StreamPlacement,
    plan_paged_layout,
    plan_state_layout,
)
from .prefix import chain_hashes, root_hash

try:
    __version__ = version("deepinfer-cache")
except PackageNotFoundError:  # pragma: no cover - imported from a source tree, not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "BlockManager",
    "PagedLayout",
    "PagedStream",
    "RegionPlacement",
    "StateLayout",
    "StateRegion",
    "StreamPlacement",
    "__version__",
    "chain_hashes",
    "plan_paged_layout",
    "plan_state_layout",
    "root_hash",
]
