"""Load a model folder's safetensors weights into DeepseekV4ForCausalLM, one tensor at a time.

Only safetensors are read (never pickles) and nothing from the folder is executed. First the
headers alone are checked against the model the config builds (`load_plan`: names in the official,
transformers and `save_pretrained` spellings, shapes, dtypes), so a checkpoint that cannot load
fails before any data is read. Then the model is allocated on the target device and each stored
tensor is read from its memory-mapped shard, dequantised if scaled (FP8 block-scaled `X.weight` e4m3
+ `X.scale` / `X.weight_scale_inv`; MXFP4 int8/uint8 + e8m0 `X.scale`), checked to be finite (and
hash-routing ids to be in range) and copied into its place — a parameter, or one expert's rows of a
stacked `experts.w13` / `.w2` — before the next is read. Routed experts asked for in `expert_dtype`
keep their stored FP8 / MXFP4 bytes, or are quantised expert by expert. Host memory beyond the model
itself is bounded by the largest tensor (docs/benchmarks/load_memory.md).

`load_format="dummy"` reads config.json alone and fills the model with seeded random weights of the
real shapes on the device (`dummy.dummy_model`), for benchmarks of a model whose checkpoint is not
at hand.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from deepinfer.kernels import packed_layout_wanted
from deepinfer.kernels.reference import dequant_fp8_block, dequant_mxfp4, scale_to_float

from .checkpoint import TensorReader, WeightError, read_headers
from .config import DeepseekV4Config
from .config_v41 import DeepseekV41Config
from .dummy import dummy_model
from .engram_vocab import compressed_token_map
from .layers.moe import Experts, quantise_expert_matrix
from .layers.moe_ep_setup import shard_experts
from .load_plan import COPY, DRAFT, ENGRAM_TABLE, KEEP, PACKED_FP4, TABLE, Placement, plan_load
from .model import DeepseekV4ForCausalLM, build_model
from .model_v41 import DeepseekV41ForCausalLM, build_model_v41
from .names import to_official

__all__ = ["LOAD_FORMATS", "WeightError", "load_model"]

_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOAD_FORMATS = ("safetensors", "dummy")


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kv_quant: bool = False,
    expert_dtype: str | None = None,
    cfg: DeepseekV4Config | DeepseekV41Config | None = None,
    progress: bool = False,
    load_format: str = "safetensors",
    seed: int = 0,
    engram_on_host: bool = False,
    local_experts: Sequence[Sequence[int]] | None = None,
) -> DeepseekV4ForCausalLM | DeepseekV41ForCausalLM:
    """Build the model of `model_dir` and stream its weights in (or make them up: `load_format`).

    Args:
        model_dir: a folder with config.json and model.safetensors or model.safetensors.index.json
            plus its shards (config.json alone for load_format="dummy").
        dtype: the model's matrices (float32, bfloat16 or float16); norms, mHC, sinks and similar
            small tensors stay float32 (`model.keeps_fp32`).
        device: where the model lives; each tensor is moved there as it is read.
        kv_quant: see `DeepseekV4ForCausalLM`.
        expert_dtype: routed experts kept in "fp8" or "fp4" (see `DeepseekV4ForCausalLM`).
        cfg: the config, if already read from `model_dir`.
        progress: show a tqdm bar over the checkpoint's bytes on stderr (nothing to show for "dummy").
        load_format: "safetensors" (read the checkpoint) or "dummy" (no checkpoint is read: seeded
            random weights of the real shapes, made on `device`; see `dummy.dummy_model`).
        seed: the seed of the "dummy" weights (unused for "safetensors").
        engram_on_host: DeepSeek-V4.1 only: keep the Engram tables in host memory (pinned when
            `device` is CUDA) and copy only the rows each step needs (`DeepseekV41ForCausalLM`).
        local_experts: one expert-parallel rank's share (DeepSeek-V4, safetensors): per MoE layer in
            `moe_layers` order, the logical expert of each of the rank's slots
            (`ExpertSlots.local_logical_ids(rank)`). Only those experts are read and allocated, a
            redundant one into each of its slots; the model must then get
            `apply_expert_parallel(model, group, slots, loaded_sharded=True)` before its first forward.

    A DeepSeek-V4.1 folder (`DeepseekV41Config`) gives a `DeepseekV41ForCausalLM`: its cache
    quantisation is part of the model (`kv_quant` has no effect on it), Engram tables stored as FP8
    rows stay FP8 (dequantised per looked-up row), the Engram token map comes from the folder's
    tokenizer.json, and the checkpoint's vision tower, aligner and image embeddings are skipped.

    Returns:
        The model in eval mode; `model.draft_weights` holds the `mtp.*` tensors on the CPU as stored
        (FP8 / MXFP4 weights with their scale under the official `….scale` name, checked finite after
        dequantisation): the MTP head of V4, the DSpark stages `mtp.0..2` (`dspark.DSparkDraft`).
        MXFP4 routed experts on a device that wants it (`deepinfer.kernels.packed_layout_wanted`) are
        re-packed for the expert kernels (`Experts.mxfp4_packed`).

    Raises:
        ConfigError: bad config.json. WeightError: an unusable checkpoint file, or a missing,
        unexpected, duplicate, mis-shaped, mis-typed or non-finite tensor (the message names the key
        and the file; no model is returned). ValueError: `dtype` is not a float dtype, an unknown
        `load_format`, a negative `seed` with "dummy", or `local_experts` with a V4.1 model, the
        dummy format, or not matching the model's MoE layers and experts.
    """
    if dtype not in _MODEL_DTYPES:
        raise ValueError(f"dtype={dtype} must be one of {', '.join(map(str, _MODEL_DTYPES))}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} must be one of {', '.join(map(repr, LOAD_FORMATS))}")
    cfg = cfg or DeepseekV4Config.from_model_dir(model_dir)
    if local_experts is not None and (isinstance(cfg, DeepseekV41Config) or load_format == "dummy"):
        raise ValueError("local_experts (a sharded expert load) works for DeepSeek-V4 checkpoints in the "
                         "safetensors format only")
    if isinstance(cfg, DeepseekV41Config):
        return _for_kernels(_load_v41(model_dir, cfg, dtype, torch.device(device), expert_dtype, progress,
                                      load_format, seed, engram_on_host))
    if load_format == "dummy":
        return _for_kernels(dummy_model(cfg, dtype=dtype, device=device, kv_quant=kv_quant, expert_dtype=expert_dtype,
                                        seed=seed))
    meta = build_model(cfg, device="meta", dtype=dtype, kv_quant=kv_quant, expert_dtype=expert_dtype)
    shards = shard_experts(meta, local_experts) if local_experts is not None else None
    plan = plan_load(read_headers(model_dir), meta.state_dict(), cfg, expert_dtype, Path(model_dir), shards)
    model = build_model(cfg, device=device, dtype=dtype, kv_quant=kv_quant, expert_dtype=expert_dtype,
                        local_experts=local_experts)
    with torch.no_grad():
        model.draft_weights = _stream(plan, model.state_dict(), _Context(cfg, expert_dtype, torch.device(device)),
                                      progress)
    return _for_kernels(model.eval())


def _for_kernels(model: Any) -> Any:
    """`model` with its MXFP4 routed experts re-packed for the expert kernels' `packed` decoder where
    their device wants it (`deepinfer.kernels.packed_layout_wanted`); the checkpoint is read as stored."""
    for module in model.modules():
        if isinstance(module, Experts) and module.expert_dtype == "fp4" and packed_layout_wanted(module.w13.device):
            module.repack_for_decode_()
    return model


def _load_v41(model_dir: str | Path, cfg: DeepseekV41Config, dtype: torch.dtype, device: torch.device,
              expert_dtype: str | None, progress: bool, load_format: str, seed: int,
              engram_on_host: bool) -> DeepseekV41ForCausalLM:
    if load_format == "dummy":
        return dummy_model(cfg, dtype=dtype, device=device, expert_dtype=expert_dtype, seed=seed,
                           engram_on_host=engram_on_host)
    headers = read_headers(model_dir)
    fp8_engram = any(to_official(k).endswith(ENGRAM_TABLE) and t.dtype == torch.float8_e4m3fn
                     for k, t in headers.items())
    token_map = compressed_token_map(model_dir, cfg.vocab_size) if cfg.engram_layer_ids else None
    build = dict(dtype=dtype, expert_dtype=expert_dtype, engram_on_host=engram_on_host, fp8_engram=fp8_engram)
    expected = build_model_v41(cfg, device="meta", **build).state_dict()
    plan = plan_load(headers, expected, cfg, expert_dtype, Path(model_dir))
    model = build_model_v41(cfg, device=device, **build)
    with torch.no_grad():
        model.draft_weights = _stream(plan, model.state_dict(), _Context(cfg, expert_dtype, device), progress)
    if token_map is not None:
        model.bind_token_map(token_map)
    model.place_engram_tables()
    return model.eval()


class _Context:
    def __init__(self, cfg: DeepseekV4Config | DeepseekV41Config, expert_dtype: str | None,
                 device: torch.device) -> None:
        self.cfg, self.expert_dtype, self.device = cfg, expert_dtype, device
        self.block = cfg.quant.fp8_block if cfg.quant else 128


def _stream(plan: list[Placement], state: dict[str, Tensor], ctx: _Context, progress: bool) -> dict[str, Tensor]:
    """Read, check and place each tensor of `plan` in turn; returns the draft tensors."""
    draft: dict[str, Tensor] = {}
    bar = _progress_bar(sum(p.nbytes for p in plan), len({p.source.path for p in plan})) if progress else None
    current_file = None
    try:
        with TensorReader() as reader:
            for p in plan:
                if p.source.path != current_file:
                    reader.close_all()            # unmap the previous shard
                    current_file = p.source.path
                    if bar is not None:
                        bar.set_postfix_str(current_file.name, refresh=False)
                _place(p, reader, state, ctx, draft)
                if bar is not None:
                    bar.update(p.nbytes)
    finally:
        if bar is not None:
            bar.close()
    return draft


def _place(p: Placement, reader: TensorReader, state: dict[str, Tensor], ctx: _Context,
           draft: dict[str, Tensor]) -> None:
    """Read one stored tensor (and its scale), check it and put it in place. Its own frame, so that
    nothing it read outlives it: the mapping of a placed tensor can be dropped."""
    source = reader.read(p.source).to(ctx.device)
    scale = reader.read(p.scale).to(ctx.device) if p.scale is not None else None
    if p.mode == DRAFT:                  # kept as stored; the draft head dequantises what it needs
        _checked(p, _values(p, source, scale, ctx))
        draft[p.target] = source.cpu().clone()
        if scale is not None:
            stem = p.target[:-len(".weight")] if p.target.endswith(".weight") else None
            draft[f"{stem}.scale" if stem else f"{p.target}_scale"] = scale.cpu().clone()
    elif p.mode == KEEP:
        for expert, (part, part_scale) in _units(p, source, scale):
            _keep(p, part, part_scale, state, expert, ctx)
    elif p.mode == COPY:
        _copy(p, source, scale, state, ctx)
    elif p.mode == TABLE:
        assert scale is not None, "an FP8 table comes with its scales (load plan)"
        codes = _e8m0_codes(p, scale)
        _checked(p, _table_rows(source, codes))
        state[p.target].copy_(source)
        state[p.target[:-len("weight")] + "scale"].copy_(codes)
    else:
        for expert, (part, part_scale) in _units(p, source, scale):
            values = _checked(p, _dequantised(p, part, part_scale, ctx.block))
            assert ctx.expert_dtype is not None, "QUANTISE placements exist only for an expert_dtype"
            weight, weight_scale = quantise_expert_matrix(values, ctx.expert_dtype, ctx.block)
            _slot(p, state, expert).copy_(weight)
            _scale_slot(p, state, expert, ctx).copy_(weight_scale)


def _progress_bar(total_bytes: int, num_files: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError as err:
        raise ImportError("load_model(progress=True) needs tqdm: pip install tqdm") from err
    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                desc=f"Loading weights ({num_files} file{'s' * (num_files != 1)})")


def _units(p: Placement, source: Tensor, scale: Tensor | None) -> list[tuple[int, tuple[Tensor, Tensor | None]]]:
    """(target slot, (an expert's matrix, its scale)) for a stacked source (every expert) or a
    per-expert one; the slot is the expert id unless the target is an EP rank's shard (`p.slots`)."""
    if p.expert is not None:
        return [(slot, (source, scale)) for slot in (p.slots if p.slots is not None else (p.expert,))]
    experts = p.slots if p.slots is not None else range(source.shape[0])
    return [(slot, (source[e], scale[e] if scale is not None else None)) for slot, e in enumerate(experts)]


def _slot(p: Placement, state: dict[str, Tensor], expert: int | None) -> Tensor:
    """The region of the target that `p` fills: all of it, one expert of a stacked target, or one
    expert's w1 / w3 row block."""
    target = state[p.target]
    if not p.stacked or expert is None:
        return target
    if p.expert is None:
        return target[expert]
    rows = target.shape[1] // 2 if p.target.endswith(".w13") else target.shape[1]
    return target[expert, p.row_start:p.row_start + rows]


def _scale_slot(p: Placement, state: dict[str, Tensor], expert: int, ctx: _Context) -> Tensor:
    scales = state[f"{p.target}_scale"][expert]
    if p.expert is None or p.target.endswith(".w2"):
        return scales
    grain = ctx.block if ctx.expert_dtype == "fp8" else 1        # FP8: one scale row per block of rows
    return scales[p.row_start // grain:(p.row_start + ctx.cfg.moe_intermediate_size) // grain]


def _e8m0_codes(p: Placement, scale: Tensor) -> Tensor:
    """An Engram table's scales as e8m0 bytes (uint8); float32 ones (transformers' `weight_scale_inv`)
    must be powers of two in e8m0's range, or WeightError naming the scale tensor."""
    assert p.scale is not None, "TABLE placements carry their scale (load plan)"
    if scale.dtype != torch.float32:
        return scale.view(torch.uint8)
    codes = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    exact = scale_to_float(codes) == scale
    if not bool(exact.all()):
        bad = float(scale[~exact][0])
        raise p.scale.error(f"{int((~exact).sum())} scale value(s) are not powers of two (e.g. {bad}); "
                            "an FP8 Engram table's scales must be e8m0")
    return codes


def _table_rows(source: Tensor, scale: Tensor) -> Tensor:
    """An Engram table's FP8 rows times their e8m0 scales (one per row and 32 channels), float32."""
    return (source.float().unflatten(-1, (-1, 32)) * scale_to_float(scale.view(torch.uint8)).unsqueeze(-1)).flatten(-2)


def _dequantised(p: Placement, source: Tensor, scale: Tensor | None, block: int) -> Tensor:
    if scale is None:
        return source
    if p.target.endswith(ENGRAM_TABLE):
        return _table_rows(source, scale)
    try:
        if source.dtype == torch.float8_e4m3fn:
            return dequant_fp8_block(source, scale, block)
        return dequant_mxfp4(source, scale)
    except ValueError as err:
        raise p.source.error(str(err)) from None


def _values(p: Placement, source: Tensor, scale: Tensor | None, ctx: _Context) -> Tensor:
    """Dequantised values of a whole source (per expert for a stacked quantised one)."""
    if scale is None or source.dim() == 2:
        return _dequantised(p, source, scale, ctx.block)
    return torch.stack([_dequantised(p, s, c, ctx.block) for s, c in zip(source, scale)])


def _copy(p: Placement, source: Tensor, scale: Tensor | None, state: dict[str, Tensor], ctx: _Context) -> None:
    if p.stacked and (p.slots is not None or (scale is not None and p.expert is None)):
        # expert by expert: a quantised stacked source into float, or any source into an EP shard
        for slot, (part, part_scale) in _units(p, source, scale):
            _fill(p, _slot(p, state, slot), _dequantised(p, part, part_scale, ctx.block))
        return
    slot = _slot(p, state, p.expert)
    _fill(p, slot, _values(p, source, scale, ctx))
    if p.target.endswith(".gate.tid2eid"):
        low, high = int(slot.min()), int(slot.max())
        if low < 0 or high >= ctx.cfg.n_routed_experts:
            bad = low if low < 0 else high
            raise p.source.error(f"expert id {bad} out of range [0, {ctx.cfg.n_routed_experts})")


def _fill(p: Placement, slot: Tensor, values: Tensor) -> None:
    """Copy (and convert) `values` into `slot`; float results must be finite."""
    slot.copy_(values)
    if slot.dtype.is_floating_point and not _all_finite(slot):
        _checked(p, values)                                       # names NaN / inf in the checkpoint
        raise p.source.error(f"finite in the checkpoint but overflows {slot.dtype}")


def _all_finite(values: Tensor) -> bool:
    """One pass, no temporary of the tensor's size: min and max propagate NaN and show ±inf."""
    if values.numel() == 0:
        return True
    low, high = torch.aminmax(values)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _checked(p: Placement, values: Tensor) -> Tensor:
    """`values` if it is not floating point or all finite; else WeightError naming the tensor."""
    if values.dtype.is_floating_point and not _all_finite(values):
        bad = int((~torch.isfinite(values)).sum())
        what = f" (dequantised with {p.scale.key})" if p.scale is not None else ""
        raise p.source.error(f"{bad} of {values.numel()} value(s) are not finite (NaN or inf){what}")
    return values


def _keep(p: Placement, weight: Tensor, scale: Tensor, state: dict[str, Tensor], expert: int, ctx: _Context) -> None:
    """Stored FP8 / MXFP4 expert bytes and their scale, as they are (after checking for NaN codes)."""
    assert p.scale is not None, "KEEP placements carry their scale (load plan)"
    if ctx.expert_dtype == "fp8":
        nan_codes = int(((weight.view(torch.uint8) & 0x7F) == 0x7F).sum())       # e4m3fn NaN: S.1111.111
        if nan_codes:
            raise p.source.error(f"{nan_codes} NaN code(s) in FP8 data")
        kept_scale = scale_to_float(scale)
        if not bool(torch.isfinite(kept_scale).all()):
            raise p.scale.error("non-finite scale value(s)")
    else:
        weight = weight.view(torch.uint8) if weight.dtype in PACKED_FP4 else weight
        kept_scale = scale.view(torch.uint8)
        if bool((kept_scale == 0xFF).any()):                                       # e8m0 NaN
            raise p.scale.error("NaN (0xFF) e8m0 scale byte(s)")
    _slot(p, state, expert).copy_(weight)
    _scale_slot(p, state, expert, ctx).copy_(kept_scale)
