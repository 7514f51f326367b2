"""Prefill/decode disaggregation (docs/design.md §15): the transports of `kv_handoff.KVTransfer`
between a PROMPT engine and a COMPLETION engine, and what serving them as a pair needs.

- `LocalKVTransfer`: both engines in one process (tests, one device holding both).
- `HttpPrefillClient`: a decode server's, a client of a prefill server (`deepinfer serve --pd-role
  decode --pd-prefill-url URL`); the handoff comes back as length-prefixed frames (`framing`).
- `PrefillExports`: a prefill server's (`deepinfer serve --pd-role prefill`); `serve.pd_routes` puts
  its handoffs on the wire.
"""

from .http_client import HttpPrefillClient
from .local import LocalKVTransfer
from .prefill_side import PrefillExports

__all__ = ["HttpPrefillClient", "LocalKVTransfer", "PrefillExports"]
