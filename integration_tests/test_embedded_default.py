"""The embedded default model through the whole engine: greedy output equals transformers'."""

from __future__ import annotations

import json

import torch
from engine_twin import hf_greedy
from safetensors.torch import load_file

from deepinfer.engine import LLM, SamplingParams
from deepinfer.model import embedded_model_dir


def test_llm_without_model_uses_the_embedded_default_and_matches_transformers() -> None:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    folder = embedded_model_dir()
    llm = LLM()                                            # no model: the embedded default
    assert llm.engine.model_dir == folder
    prompts = ["def fibonacci(", "import os\n\nclass ", "    for i in range("]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**json.loads((folder / "config.json").read_text())))
    hf.load_state_dict({k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}, strict=True)
    hf = hf.float().eval()
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == llm.engine.tokenizer.encode(prompt)
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 24)
        assert out.outputs[0].text == llm.engine.tokenizer.decode(out.outputs[0].token_ids)
    assert any(kw in "".join(o.outputs[0].text for o in outs) for kw in ("self", "return", "(", ":"))


def test_bfloat16_greedy_matches_transformers_in_bfloat16() -> None:
    """bf16 changes this tiny model's greedy path (it degenerates into a repetition); transformers in
    bf16 takes exactly the same path, so the engine's bf16 numerics follow the reference's."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    folder = embedded_model_dir()
    out = LLM(dtype="bfloat16", max_num_seqs=2).generate(
        ["def fibonacci("], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**json.loads((folder / "config.json").read_text())))
    hf.load_state_dict({k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}, strict=True)
    hf = hf.to(torch.bfloat16).eval()
    assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 12)
