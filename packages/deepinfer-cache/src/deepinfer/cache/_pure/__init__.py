"""Pure-Python twins of the Cython pools (STYLE.md guideline 10), run on the same tests."""
