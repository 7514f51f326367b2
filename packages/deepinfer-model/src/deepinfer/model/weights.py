"""Load a model folder's safetensors weights into DeepseekV4ForCausalLM.

Only safetensors are read (never pickles) and nothing from the folder is executed. FP8 block-scaled
weights (`X.weight` e4m3 + `X.scale` or `X.weight_scale_inv`) and MXFP4 experts (int8/uint8
`X.weight` + e8m0 `X.scale`) are dequantised on load — except, when asked (`expert_dtype`), the
routed experts, which stay FP8 / MXFP4 (or are quantised to it). Every tensor is checked against the model's
expected names and shapes before anything is assigned, so a bad checkpoint loads nothing.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from deepinfer.kernels.reference import dequant_fp8_block, dequant_mxfp4, scale_to_float

from .config import DeepseekV4Config
from .layers.moe import quantise_expert_matrix
from .model import DeepseekV4ForCausalLM, build_model
from .names import expert_part, is_draft_key, to_official

_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


class WeightError(ValueError):
    """A missing, unexpected or mis-shaped weight; the message names the key."""


@dataclass(frozen=True, slots=True)
class CheckpointFiles:
    """The safetensors files of a model folder and which file holds which key."""

    files: tuple[Path, ...]


def find_checkpoint(model_dir: str | Path) -> CheckpointFiles:
    """`model.safetensors`, or the shards named by `model.safetensors.index.json`."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        with index.open(encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightError(f"{index}: missing or empty 'weight_map'")
        files = []
        for name in sorted(set(weight_map.values())):
            path = root / name
            if Path(name).name != name or not name.endswith(".safetensors"):
                raise WeightError(f"{index}: shard name {name!r} must be a plain *.safetensors file name")
            if not path.is_file():
                raise WeightError(f"{index}: shard {name!r} does not exist")
            files.append(path)
        return CheckpointFiles(tuple(files))
    single = root / "model.safetensors"
    if single.is_file():
        return CheckpointFiles((single,))
    raise WeightError(f"{root}: no model.safetensors or model.safetensors.index.json")


def read_tensors(files: CheckpointFiles) -> dict[str, Tensor]:
    """Every tensor of every file, by its stored key (duplicate keys are an error)."""
    out: dict[str, Tensor] = {}
    for path in files.files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key in out:
                    raise WeightError(f"key {key!r} appears in more than one shard")
                out[key] = f.get_tensor(key)
    return out


def _scale_key(key: str, raw: dict[str, Tensor]) -> str | None:
    """The scale tensor that belongs to weight `key`, if the checkpoint has one."""
    if not key.endswith(".weight"):
        return None
    stem = key[: -len(".weight")]
    return next((stem + s for s in _SCALE_SUFFIXES if stem + s in raw), None)


def _dequantize(raw: dict[str, Tensor], cfg: DeepseekV4Config, expert_dtype: str | None = None) -> dict[str, Tensor]:
    """Fold scale tensors into their weights; returns float tensors (or integer tables) by key. Routed
    experts already stored as `expert_dtype` ("fp8": e4m3 weights; "fp4": packed MXFP4 bytes) stay
    so, their scales kept as `….scale` (float32 for FP8, uint8-coded e8m0 for MXFP4)."""
    block = cfg.quant.fp8_block if cfg.quant else 128
    scale_of = {key: _scale_key(key, raw) for key in raw}
    scales = {s for s in scale_of.values() if s is not None}
    out: dict[str, Tensor] = {}
    for key, t in raw.items():
        if key in scales:
            continue
        scale_key = scale_of[key]
        if scale_key is not None and _stored_as(t, expert_dtype) and expert_part(to_official(key)) is not None:
            out[key] = t.view(torch.uint8) if expert_dtype == "fp4" else t
            out[key[: -len(".weight")] + ".scale"] = _kept_scale(raw[scale_key], expert_dtype)
            continue
        try:
            out[key] = _dequantize_one(t, raw[scale_key] if scale_key else None, block)
        except ValueError as err:
            raise WeightError(f"{key}: {err}") from None
    return out


def _stored_as(t: Tensor, expert_dtype: str | None) -> bool:
    return (expert_dtype == "fp8" and t.dtype == torch.float8_e4m3fn) or \
        (expert_dtype == "fp4" and t.dtype in (torch.int8, torch.uint8))


def _kept_scale(scale: Tensor, expert_dtype: str | None) -> Tensor:
    """FP8: float32; MXFP4: uint8-coded e8m0 (2^(byte − 127))."""
    if expert_dtype == "fp8":
        return scale_to_float(scale)
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        return scale.view(torch.uint8)
    return (torch.log2(scale.float()) + 127).round().to(torch.uint8)


def _dequantize_one(t: Tensor, scale: Tensor | None, block: int) -> Tensor:
    if t.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise ValueError("FP8 weight without a scale tensor")
        return dequant_fp8_block(t, scale, block)
    if scale is None:
        return t
    if t.dtype in (torch.int8, torch.uint8):
        return dequant_mxfp4(t, scale)
    raise ValueError(f"has a scale tensor but dtype {t.dtype} is neither FP8 nor packed FP4")


def _stack_experts(tensors: dict[str, Tensor], cfg: DeepseekV4Config) -> dict[str, Tensor]:
    parts: dict[str, dict[int, dict[str, Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out: dict[str, Tensor] = {}
    for key, t in tensors.items():
        hit = expert_part(key)
        if hit is None:
            out[key] = t
        else:
            prefix, expert, which = hit
            parts[prefix][expert][which] = t
    for prefix, experts in parts.items():
        kept = any(part.endswith(".scale") for p in experts.values() for part in p)   # stored quantised
        needed = ("w1", "w2", "w3") + (("w1.scale", "w2.scale", "w3.scale") if kept else ())
        for e in range(cfg.n_routed_experts):
            for which in needed:
                if which not in experts.get(e, {}):
                    raise WeightError(f"missing {prefix}.{e}.{which}" + ("" if which.endswith(".scale") else ".weight"))
        extra = sorted(set(experts) - set(range(cfg.n_routed_experts)))
        if extra:
            raise WeightError(
                f"unexpected expert id(s) {extra} under {prefix} (n_routed_experts={cfg.n_routed_experts})"
            )
        ordered = [experts[e] for e in range(cfg.n_routed_experts)]
        out[f"{prefix}.w13"] = torch.stack([torch.cat((p["w1"], p["w3"]), 0) for p in ordered])
        out[f"{prefix}.w2"] = torch.stack([p["w2"] for p in ordered])
        if kept:
            out[f"{prefix}.w13_scale"] = torch.stack([torch.cat((p["w1.scale"], p["w3.scale"]), 0) for p in ordered])
            out[f"{prefix}.w2_scale"] = torch.stack([p["w2.scale"] for p in ordered])
    return out


def _quantize_experts(backbone: dict[str, Tensor], expert_dtype: str, block: int) -> None:
    """Routed experts the checkpoint stores otherwise (bf16, or dequantised on load) → `expert_dtype`:
    each stacked expert matrix through `quantise_expert_matrix`, scales alongside."""
    for key in [k for k in backbone if k.endswith((".experts.w13", ".experts.w2"))]:
        t = backbone[key]
        if f"{key}_scale" in backbone:
            continue                                      # kept as stored
        try:
            pairs = [quantise_expert_matrix(m, expert_dtype, block) for m in t]
        except ValueError as err:
            raise WeightError(f"{key}: cannot quantise to {expert_dtype}: {err}") from None
        backbone[key] = torch.stack([q for q, _ in pairs])
        backbone[f"{key}_scale"] = torch.stack([s for _, s in pairs])


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    """Backbone tensors by model parameter name, and the draft-head (`mtp.*`) tensors kept aside."""

    backbone: dict[str, Tensor]
    draft: dict[str, Tensor]


def load_weights(model_dir: str | Path, cfg: DeepseekV4Config, *, expert_dtype: str | None = None) -> LoadedWeights:
    """Read, dequantise, rename and stack a folder's weights (no checking against a model yet).
    With `expert_dtype` ("fp8" / "fp4") the routed experts come out in that format with their scales
    (`experts.w13_scale`, `.w2_scale`): as stored when the checkpoint has them so, else quantised."""
    tensors = _dequantize(read_tensors(find_checkpoint(model_dir)), cfg, expert_dtype)
    backbone, draft = {}, {}
    for key, t in tensors.items():
        name = to_official(key)
        (draft if is_draft_key(name) else backbone)[name] = t
    backbone = _stack_experts(backbone, cfg)
    if expert_dtype is not None:
        _quantize_experts(backbone, expert_dtype, cfg.quant.fp8_block if cfg.quant else 128)
    return LoadedWeights(backbone, draft)


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kv_quant: bool = False,
    expert_dtype: str | None = None,
    cfg: DeepseekV4Config | None = None,
) -> DeepseekV4ForCausalLM:
    """Build the model of `model_dir` and load its weights (`expert_dtype`: routed experts kept in
    "fp8" or "fp4", see `DeepseekV4ForCausalLM`).

    Raises:
        ConfigError: bad config.json. WeightError: a missing, unexpected or mis-shaped tensor
        (nothing is loaded then).
    """
    cfg = cfg or DeepseekV4Config.from_model_dir(model_dir)
    with torch.device("meta"):                    # first: a config the format cannot take fails fast
        expected = DeepseekV4ForCausalLM(cfg, kv_quant=kv_quant, expert_dtype=expert_dtype).state_dict()
    weights = load_weights(model_dir, cfg, expert_dtype=expert_dtype)
    missing = sorted(set(expected) - set(weights.backbone))
    if missing:
        k = missing[0]
        raise WeightError(f"missing weight {k!r} (expected shape {tuple(expected[k].shape)})"
                          + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    unexpected = sorted(set(weights.backbone) - set(expected))
    if unexpected:
        raise WeightError(f"unexpected weight(s): {', '.join(unexpected[:5])}")
    for key, t in weights.backbone.items():
        if tuple(t.shape) != tuple(expected[key].shape):
            raise WeightError(f"{key}: shape {tuple(t.shape)} != expected {tuple(expected[key].shape)}")
    model = build_model(cfg, device=device, dtype=dtype, kv_quant=kv_quant, expert_dtype=expert_dtype)
    target = model.state_dict()
    state = {key: t.to(device=device, dtype=target[key].dtype) for key, t in weights.backbone.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.draft_weights = weights.draft
    return model.eval()
