"""Pure numpy twins of the Cython modules (same signatures and results; run on the same tests)."""
