"""Speculative decoding over the core step: the DSpark speculative Step (`spec_step`), its draft walk
and greedy verification on static buffers, one CUDA graph per size (`draft_graphs`, `verify_tails`),
and the varlen verify profile that decides how many drafts pay (`varlen_profile`). docs/design.md §6.
"""
