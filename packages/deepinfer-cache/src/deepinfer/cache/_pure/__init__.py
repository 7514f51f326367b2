"""Pure-Python twins of the Cython pools (docs/design.md §4), run on the same tests."""
