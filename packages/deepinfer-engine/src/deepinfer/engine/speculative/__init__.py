"""Speculative decoding over the core step: the DSpark speculative Step (`spec_step`), the varlen
verify profile that decides how many drafts pay (`varlen_profile`, measured over `spec_dummy`'s dummy
work), and the verify size lockstep DP + EP ranks agree on (`spec_lockstep`). docs/design.md §6.
"""
