"""Helpers of the integration tests: tiny model folders and transformers' greedy generation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parents[1] / "packages" / "deepinfer-model" / "tests"))

from hf_twin import hf_model

__all__ = ["byte_bpe_tokenizer_json", "hf_greedy", "hf_model", "random_prompts", "write_model_dir"]


def write_model_dir(path: Path, hf, raw: dict, tokenizer_json: str | None = None) -> Path:
    """A Hugging Face-layout folder (config.json, model.safetensors[, tokenizer.json])."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(path / "model.safetensors"))
    if tokenizer_json is not None:
        (path / "tokenizer.json").write_text(tokenizer_json)
    return path


def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths, vocab: int = 96, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


def byte_bpe_tokenizer_json(vocab_size: int, seed_text: str) -> str:
    """A byte-level BPE tokenizer (the `tokenizers` library) trained on `seed_text`, as JSON,
    with "<eos>" as token 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([seed_text] * 4, trainer)
    return tok.to_str()
