"""deepinfer.spec — speculative decoding (DSpark/DFlash drafting, verification, varlen verify).

Honest skeleton: this package has no public API yet. Its content (the DSpark draft glue,
rejection-sampling verification and the varlen verify-length policy of DESIGN.md §6) arrives with
the speculative-decoding work; until then the engine decodes one token per step.
"""

from importlib.metadata import version as _version

__version__ = _version("deepinfer-spec")
__all__: list[str] = []
