"""Speculative decoding over the core step: the DSpark speculative Step (`spec_step`) and the varlen
verify profile that decides how many drafts pay (`varlen_profile`). docs/design.md §6.
"""
