"""Prefill/decode disaggregation (docs/design.md §15): the transports of `kv_handoff.KVTransfer`
between a PROMPT engine and a COMPLETION engine, and serving them as a pair.

- `LocalKVTransfer`: both engines in one process.
"""

from .local import LocalKVTransfer

__all__ = ["LocalKVTransfer"]
