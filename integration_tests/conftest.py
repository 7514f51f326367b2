"""Cross-package tests: the engine end to end against transformers' DeepseekV4ForCausalLM."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from engine_twin import byte_bpe_tokenizer_json, hf_model, write_model_dir


@pytest.fixture(scope="session", autouse=True)
def varlen_profile_cache(tmp_path_factory):
    """Engines started here keep varlen step-time curves in a temporary file, never in the user's
    cache folder (DEEPINFER_VARLEN_PROFILE_CACHE)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_VARLEN_PROFILE_CACHE",
                     str(tmp_path_factory.mktemp("varlen_profile") / "varlen_profile.json"))
        yield


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(transformers model, model folder) of a tiny random V4 with every layer type."""
    hf, raw = hf_model(seed=11)
    return hf, write_model_dir(tmp_path_factory.mktemp("tiny"), hf, raw)




TEXT = """def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)
"""


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory):
    """(transformers model, model folder with a byte-level BPE tokenizer.json; "<eos>" = id 0)."""
    tokenizer = byte_bpe_tokenizer_json(320, TEXT)
    hf, raw = hf_model(seed=12, vocab_size=320)
    raw = {**raw, "eos_token_id": 0, "bos_token_id": None}
    return hf, write_model_dir(tmp_path_factory.mktemp("tiny_text"), hf, raw, tokenizer)
