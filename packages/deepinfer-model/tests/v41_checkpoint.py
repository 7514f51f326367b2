"""Tiny DeepSeek-V4.1 model folders written in the official, transformers and FP8 / MXFP4 forms."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from v41_configs import tiny_text
from v41_helpers import tiny_model

from deepinfer.kernels.reference import dequant_mxfp4, quant_mxfp4
from deepinfer.model import DeepseekV41ForCausalLM
from deepinfer.model.engram_vocab import token_map_of

WORDS = ["Hello", "hello", "HELLO", "café", "cafe", "Café", " ", "\t", "the", "The", " the", "ﬁ", "fi"]
# FP8 (block 32, e8m0 scales) in the official checkpoint: the projections; bf16: norms, router,
# compressor, indexer weights_proj / wk, embeddings, head.
FP8_KEYS = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|shared_experts\.w[123]|engram\.wkv)\.weight$")


def tokenizer():
    """A word-level tokenizer of 96 ids whose words normalise alike in groups (case, accents, NFKC)."""
    from tokenizers import Tokenizer, models

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    for w in WORDS:
        vocab[w] = len(vocab)
    for i in range(len(vocab), 96):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    return tok


def folder_model(seed: int = 0) -> tuple[DeepseekV41ForCausalLM, dict]:
    """A tiny model whose Engram vocabulary is the tokenizer's, and its flat config."""
    token_map = token_map_of(tokenizer(), 96)
    raw = tiny_text(engram_compressed_vocab_size=int(token_map.max()) + 1)
    model = tiny_model(seed, engram_compressed_vocab_size=raw["engram_compressed_vocab_size"])
    model.bind_token_map(token_map)
    return model, raw


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w → (e4m3 weight, e8m0 scales per 32 × 32 block, dequantised) with power-of-two scales."""
    out_dim, in_dim = w.shape
    blocks = w.float().reshape(out_dim // 32, 32, in_dim // 32, 32)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
    q = (w.float() / full).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu), q.float() * full


def official_tensors(model: DeepseekV41ForCausalLM, *, quantised: bool) -> dict[str, torch.Tensor]:
    """Official names, per-expert; with `quantised`, FP8 projections, MXFP4 experts and an FP8 Engram
    table — and the model's own weights replaced by the dequantised values (so logits must match)."""
    out: dict[str, torch.Tensor] = {}
    state = model.state_dict()
    with torch.no_grad():
        for key, t in state.items():
            t = t.detach().clone()
            m = re.match(r"(layers\.\d+\.ffn\.experts)\.(w13|w2)$", key)
            if m:
                prefix, which = m.groups()
                for e in range(t.shape[0]):
                    parts = {"w1": t[e, :t.shape[1] // 2], "w3": t[e, t.shape[1] // 2:]} if which == "w13" \
                        else {"w2": t[e]}
                    for part, w in parts.items():
                        if quantised:
                            packed, scale = quant_mxfp4(w)
                            w.copy_(dequant_mxfp4(packed, scale))
                            out[f"{prefix}.{e}.{part}.weight"] = packed.view(torch.int8)
                            out[f"{prefix}.{e}.{part}.scale"] = scale.view(torch.float8_e8m0fnu)
                        else:
                            out[f"{prefix}.{e}.{part}.weight"] = w.clone()
                state[key].copy_(t)
            elif quantised and FP8_KEYS.search(key):
                q, scale, deq = _fp8_blocks(t)
                out[key], out[key[:-len("weight")] + "scale"] = q, scale
                state[key].copy_(deq)
            elif quantised and key.endswith(".engram.embed.weight"):
                amax = t.float().unflatten(-1, (-1, 32)).abs().amax(-1).clamp_min(1e-12)
                scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
                q = (t.float().unflatten(-1, (-1, 32)) / scale.unsqueeze(-1)).flatten(-2).to(torch.float8_e4m3fn)
                out[key], out[key[:-len("weight")] + "scale"] = q, scale.to(torch.float8_e8m0fnu)
                state[key].copy_((q.float().unflatten(-1, (-1, 32)) * scale.unsqueeze(-1)).flatten(-2))
            else:
                out[key] = t
    out["mtp.0.main_proj.weight"] = torch.ones(4, 4)                 # a DSpark stage: kept aside
    return out


def transformers_tensors(model: DeepseekV41ForCausalLM) -> dict[str, torch.Tensor]:
    """transformers' module names: `model.`-prefixed official names, `lm_head`, per-expert ModuleList."""
    out = {}
    for key, t in official_tensors(model, quantised=False).items():
        if key.startswith("mtp."):
            continue
        out["lm_head.weight" if key == "head.weight" else f"model.{key}"] = t
    return out


def write_folder(path: Path, model: DeepseekV41ForCausalLM, raw: dict, tensors: dict, *, composite: bool) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = raw
    if composite:
        text = {k: v for k, v in raw.items() if k != "model_type"}
        config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                  "text_config": {"model_type": "deepseek_v41_text", **text},
                  "vision_config": {"model_type": "deepseek_v41_vision", "hidden_size": 16},
                  "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32],
                                          "scale_fmt": "ue8m0", "expert_dtype": "fp4"}}
        tensors = {**tensors, "vision.patch.weight": torch.zeros(2, 2), "image_newline": torch.zeros(4)}
    (path / "config.json").write_text(json.dumps(config))
    tokenizer().save(str(path / "tokenizer.json"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path
