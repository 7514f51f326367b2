"""Code passages of the embedded model's held-out sample (plistlib.py, never trained on): the prompts of
the tests that measure how often its draft head is accepted."""

from __future__ import annotations

from deepinfer.model import embedded_model_dir

PASSAGES = ((140, 152), (196, 208), (120, 132))      # line ranges of heldout_sample.txt


def heldout_code(count: int = 2) -> list[str]:
    """The first `count` passages of PASSAGES, each a str of 12 lines."""
    lines = (embedded_model_dir() / "heldout_sample.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    return ["".join(lines[start:stop]) for start, stop in PASSAGES[:count]]
