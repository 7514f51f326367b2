"""The verify-length hook (docs/design.md §3.3, §7.2): the scheduler asks an injected policy how many query
tokens each decode sequence feeds; deepinfer.spec satisfies the Protocol structurally and the
engine injects it, so this package never imports spec."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["VerifyLengthPolicy"]


@runtime_checkable
class VerifyLengthPolicy(Protocol):
    """Assigns each sequence of a decode batch its query length (last token + drafts to verify)."""

    def query_lens(self, seq_ids: tuple[str, ...], seq_lens: np.ndarray, max_query_len: int) -> np.ndarray:
        """Query lengths of one decode batch.

        Args:
            seq_ids: [num_seqs] ids, sorted by seq_lens descending.
            seq_lens: [num_seqs] int32 K lengths after the step (read-only).
            max_query_len: nextn + 1, the positions reserved per sequence.

        Returns:
            [num_seqs] integer array, each in [1, max_query_len].
        """
        ...


def checked_query_lens(result: object, num_seqs: int, max_query_len: int) -> np.ndarray:
    """The policy's answer as int32, after checking its shape and range."""
    lens = np.asarray(result)
    if lens.shape != (num_seqs,) or lens.dtype.kind not in "iu":
        raise ValueError(
            f"verify policy returned shape {lens.shape} dtype {lens.dtype}; "
            f"expected [{num_seqs}] integers"
        )
    if num_seqs and (int(lens.min()) < 1 or int(lens.max()) > max_query_len):
        raise ValueError(
            f"verify policy returned query lengths in [{int(lens.min())}, {int(lens.max())}]; "
            f"allowed range is [1, {max_query_len}]"
        )
    return lens.astype(np.int32, copy=False)
