"""Both model classes are what the engine drives (`CausalLM`), and the DSpark draft head is what they
take (`DraftHead`); neither model class derives from the other."""

from __future__ import annotations

import torch
from test_config import FLASH
from v41_configs import tiny_text

from deepinfer.model import (
    CausalLM,
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    DeepseekV41Config,
    DeepseekV41ForCausalLM,
    DraftHead,
    DSparkDraft,
)


def test_the_v4_and_v41_models_are_causal_lms() -> None:
    with torch.device("meta"):
        models = [DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(FLASH)),
                  DeepseekV41ForCausalLM(DeepseekV41Config.from_dict(tiny_text()))]
    for model in models:
        assert isinstance(model, CausalLM), type(model).__name__
    assert not issubclass(DeepseekV41ForCausalLM, DeepseekV4ForCausalLM)
    assert not issubclass(DeepseekV4ForCausalLM, DeepseekV41ForCausalLM)


def test_the_dspark_draft_is_a_draft_head() -> None:
    assert issubclass(DSparkDraft, DraftHead)
    assert not issubclass(DeepseekV4ForCausalLM, DraftHead)
