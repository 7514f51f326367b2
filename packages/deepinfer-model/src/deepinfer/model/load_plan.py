"""Where each stored tensor goes, decided from the checkpoint's headers before any data is read.

Every stored key is named (`names.to_official`), paired with its scale, and given a target: a model
parameter, a row block of one expert in a stacked `experts.w13` / `.w2`, or the draft-head dict.
Names, shapes and dtypes are checked here against the model the config builds, so a checkpoint
that cannot load fails before a byte of weights is read (`WeightError` naming the key and file).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .checkpoint import StoredTensor, WeightError
from .config import DeepseekV4Config, file_problem, read_json_object
from .config_v41 import DeepseekV41Config
from .names import expert_part, is_draft_key, to_official

ModelConfig = DeepseekV4Config | DeepseekV41Config

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INTEGERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
HALF_FLOATS = {"float16": torch.float16, "bfloat16": torch.bfloat16}
PACKED_FP4 = (torch.int8, torch.uint8)              # two e2m1 codes per byte
FP8_SCALES = (torch.float8_e8m0fnu, torch.float32)
FP4_SCALES = (torch.float8_e8m0fnu, torch.uint8)    # uint8 = e8m0 bits
TABLE_SCALES = FP4_SCALES + (torch.float32,)        # float32 (save_pretrained's weight_scale_inv): powers of two
COPY, KEEP, QUANTISE, DRAFT, TABLE = "copy", "keep", "quantise", "draft", "table"
# DeepSeek-V4.1 checkpoint parts this text-only engine does not serve (the vision tower, its aligner
# and the image delimiter embeddings), skipped when planning a V4.1 load.
_V41_SKIPPED = re.compile(r"^(vision|aligner)\.|^image_(start|end|newline)$")
ENGRAM_TABLE = ".engram.embed.weight"     # FP8 rows with one e8m0 scale per row and 32 channels


@dataclass(frozen=True, slots=True)
class Placement:
    """One stored weight (with its scale) and where it goes.

    mode: COPY (float or integer values, dequantised first if scaled, converted to the target's
    dtype), KEEP (quantised expert bytes and scale as stored), QUANTISE (float values → the
    model's `expert_dtype`), DRAFT (kept aside, dequantised, on CPU), TABLE (a V4.1 Engram table's
    FP8 rows and e8m0 scales, into `….embed.weight` / `….embed.scale`; float32 scales must be powers
    of two). A float Engram table's scale is not read (`save_pretrained` writes one of ones).
    """

    source: StoredTensor
    scale: StoredTensor | None
    target: str                   # parameter / buffer name, or the draft key
    mode: str
    expert: int | None = None     # one expert of a stacked target; None with `stacked` = all of them
    row_start: int = 0            # first row of that expert's matrix this source fills (w3 after w1)
    stacked: bool = False         # target is a stacked [experts, rows, cols] expert tensor
    # An EP rank's shard of a stacked target (`moe_ep_setup.shard_experts`): for one expert's source, the
    # target slots it fills (a redundant expert fills several); for a source of all experts, the
    # expert each target slot takes. None: target row = expert id.
    slots: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.source.nbytes + (self.scale.nbytes if self.scale else 0)


def plan_load(stored: dict[str, StoredTensor], expected: dict[str, Tensor], cfg: ModelConfig,
              expert_dtype: str | None, model_dir: Path,
              expert_shards: dict[str, tuple[int, ...]] | None = None) -> list[Placement]:
    """Placements in reading order (file, then offset); raises WeightError for any missing,
    unexpected, duplicate, mis-shaped or mis-typed tensor. `expected`: the model's state dict (meta);
    `model_dir`: named in messages about tensors the checkpoint lacks; `expert_shards`: an EP rank's
    experts (`moe_ep_setup.shard_experts`' result): other experts' tensors are left unread (still checked)."""
    scale_of = {key: _scale_key(key, stored) for key in stored}
    scales = {s for s in scale_of.values() if s is not None}
    placements, unexpected = [], []
    v41 = not isinstance(cfg, DeepseekV4Config)
    for key, tensor in stored.items():
        if key in scales or (v41 and _V41_SKIPPED.search(to_official(key))):
            continue
        scale = stored[scale_key] if (scale_key := scale_of[key]) else None
        placement = _place(tensor, scale, expected, expert_dtype)
        if placement is None:
            unexpected.append(tensor)
        else:
            placements.append(placement)
    if unexpected:
        raise WeightError("unexpected weight(s): " + ", ".join(t.where() for t in unexpected[:5])
                          + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""))
    shards = expert_shards or {}
    _check_coverage(placements, expected, cfg, model_dir, shards)
    block = cfg.quant.fp8_block if cfg.quant else 128
    for p in placements:
        _check(p, expected, cfg, expert_dtype, block)
    _check_half_floats([p.source for p in placements], _declared_half_float(model_dir))
    if shards:
        placements = [local for p in placements if (local := _to_shard(p, shards)) is not None]
    return sorted(placements, key=lambda p: (str(p.source.path), p.source.order))


def _declared_half_float(model_dir: Path) -> torch.dtype | None:
    """config.json's torch_dtype (or dtype) when it names a 16-bit float type, else None."""
    path = model_dir / "config.json"
    if file_problem(path) is not None:
        return None
    raw = read_json_object(path, WeightError, what="")
    value = raw.get("torch_dtype", raw.get("dtype"))
    return HALF_FLOATS.get(value) if isinstance(value, str) else None


def _check_half_floats(tensors: list[StoredTensor], declared: torch.dtype | None) -> None:
    """Every float16 / bfloat16 tensor has the checkpoint's 16-bit type: config.json's torch_dtype when
    it names one, else the type most of them have. The two have the same size, so a header that
    mislabels one as the other loads without any other error, as wrong values."""
    halves = [t for t in tensors if t.dtype in HALF_FLOATS.values()]
    if declared is not None:
        basis = f"config.json torch_dtype is {declared}"
    else:
        counts: dict[torch.dtype, int] = {}
        for t in halves:
            counts[t.dtype] = counts.get(t.dtype, 0) + 1
        if len(counts) < 2:
            return
        declared = max(counts, key=counts.__getitem__)
        basis = f"{counts[declared]} of its {len(halves)} 16-bit float tensors are {declared}"
    odd = next((t for t in halves if t.dtype != declared), None)
    if odd is not None:
        raise odd.error(f"dtype {odd.dtype} in a checkpoint whose 16-bit floats are {declared} ({basis}): a "
                        "mislabelled header would load as wrong values; store it as " + str(declared))


def _to_shard(p: Placement, shards: dict[str, tuple[int, ...]]) -> Placement | None:
    """`p` aimed at its EP rank's slots; None for one expert that has no slot on this rank."""
    experts = shards.get(p.target.rsplit(".", 1)[0]) if p.stacked else None
    if experts is None:
        return p
    if p.expert is None:
        return dataclasses.replace(p, slots=experts)
    slots = tuple(slot for slot, expert in enumerate(experts) if expert == p.expert)
    return dataclasses.replace(p, slots=slots) if slots else None


def _scale_key(key: str, stored: dict[str, StoredTensor]) -> str | None:
    """The scale tensor that belongs to `key`, if the checkpoint has one."""
    if key.endswith(".weight"):
        stem = key[: -len(".weight")]
        return next((stem + s for s in (".scale", ".weight_scale_inv") if stem + s in stored), None)
    if to_official(key).endswith((".experts.w13", ".experts.w2")) and key + "_scale" in stored:
        return key + "_scale"                     # a stacked quantised expert tensor (this model's own names)
    return None


def _place(tensor: StoredTensor, scale: StoredTensor | None, expected: dict[str, Tensor],
           expert_dtype: str | None) -> Placement | None:
    name = to_official(tensor.key)
    if is_draft_key(name):
        return Placement(tensor, scale, name, DRAFT)
    hit = expert_part(name)
    if hit is not None:
        prefix, expert, which = hit
        if which.endswith(".scale"):
            return None                           # a scale whose weight is absent
        target = f"{prefix}.{'w2' if which == 'w2' else 'w13'}"
        if target not in expected:
            return None
        rows = expected[target].shape[1] // 2 if which == "w3" else 0
        return Placement(tensor, scale, target, _mode(tensor, scale, expert_dtype), expert, rows, stacked=True)
    if name not in expected:
        return None
    if name.endswith(ENGRAM_TABLE) and scale is not None:
        if tensor.dtype != torch.float8_e4m3fn:
            _check_unused_table_scale(tensor, scale)
            return Placement(tensor, None, name, COPY)
        if name[:-len("weight")] + "scale" in expected:
            return Placement(tensor, scale, name, TABLE)
    stacked = name.endswith((".experts.w13", ".experts.w2"))
    return Placement(tensor, scale, name, _mode(tensor, scale, expert_dtype) if stacked else COPY, stacked=stacked)


def _check_unused_table_scale(table: StoredTensor, scale: StoredTensor) -> None:
    """A float Engram table's scale (transformers' `save_pretrained` writes one beside every table,
    all ones; its model, like ours, reads it only for FP8 rows): checked for shape, then left unread."""
    want = table.shape[:-1] + (table.shape[-1] // 32,) if table.shape else ()
    if scale.shape != want:
        raise scale.error(f"scale shape {scale.shape} != expected {want} for Engram table shape {table.shape}")


def _mode(tensor: StoredTensor, scale: StoredTensor | None, expert_dtype: str | None) -> str:
    if expert_dtype is None:
        return COPY
    if scale is not None and ((expert_dtype == "fp8" and tensor.dtype == torch.float8_e4m3fn)
                              or (expert_dtype == "fp4" and tensor.dtype in PACKED_FP4)):
        return KEEP
    return QUANTISE


def _check_coverage(placements: list[Placement], expected: dict[str, Tensor], cfg: ModelConfig,
                    model_dir: Path, shards: dict[str, tuple[int, ...]]) -> None:
    """Each parameter filled exactly once (each expert's w1, w3 and w2 too, of a sharded target the
    experts of its slots); scales of quantised experts are filled with their weights."""
    filled: dict[str, dict[tuple[int | None, int], Placement]] = {}
    for p in placements:
        if p.mode == DRAFT:
            continue
        units = filled.setdefault(p.target, {})
        clash = units.get((p.expert, p.row_start)) or units.get((None, 0)) or \
            (next(iter(units.values())) if units and p.expert is None else None)
        if clash is not None:
            raise WeightError(f"{p.target!r} is given twice: by {clash.source.where()} and by {p.source.where()}")
        units[(p.expert, p.row_start)] = p
        if p.mode == TABLE:
            filled[p.target[:-len("weight")] + "scale"] = {(None, 0): p}
    inter = cfg.moe_intermediate_size
    for name, t in expected.items():
        units = filled.get(name, {})
        if name.endswith((".experts.w13_scale", ".experts.w2_scale")) or (None, 0) in units:
            continue
        if not name.endswith((".experts.w13", ".experts.w2")):
            raise WeightError(f"missing weight {name!r} (expected shape {tuple(t.shape)}) in {model_dir}")
        prefix = name.rsplit(".", 1)[0]
        parts = (("w1", 0), ("w3", inter)) if name.endswith("w13") else (("w2", 0),)
        for expert in sorted(set(shards.get(prefix, range(cfg.n_routed_experts)))):
            for part, row_start in parts:
                if (expert, row_start) not in units:
                    shape = (cfg.hidden_size, inter) if part == "w2" else (inter, cfg.hidden_size)
                    raise WeightError(f"missing weight '{prefix}.{expert}.{part}.weight' (expected shape {shape}; "
                                      f"or the stacked {name!r}) in {model_dir}")


def _float_shape(p: Placement, expected: dict[str, Tensor], cfg: ModelConfig) -> tuple[int, ...]:
    """The shape of the values `p` provides, in float (unpacked, dequantised) terms."""
    if not p.stacked:
        return tuple(expected[p.target].shape)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    matrix = (h, i) if p.target.endswith(".w2") else (i, h)
    if p.expert is not None:
        return matrix
    return (cfg.n_routed_experts, 2 * matrix[0] if p.target.endswith(".w13") else matrix[0], matrix[1])


def _check(p: Placement, expected: dict[str, Tensor], cfg: ModelConfig, expert_dtype: str | None,
           block: int) -> None:
    src, scale = p.source, p.scale
    if p.expert is not None and p.expert >= cfg.n_routed_experts:
        raise src.error(f"expert id {p.expert} out of range (n_routed_experts={cfg.n_routed_experts})")
    packed = scale is not None and src.dtype in PACKED_FP4
    shape = src.shape[:-1] + (src.shape[-1] * 2,) if packed and src.shape else src.shape
    if p.mode != DRAFT and shape != _float_shape(p, expected, cfg):
        stored = f"shape {src.shape}" + (" (packed FP4: two values per byte)" if packed else "")
        raise src.error(f"{stored} != expected {_float_shape(p, expected, cfg)}"
                        + (f" for {p.target!r}" if p.target != to_official(src.key) else ""))
    integer_target = p.mode != DRAFT and not p.stacked and expected[p.target].dtype in INTEGERS
    if scale is None:
        _check_unscaled(p, integer_target)
        return
    if integer_target:
        raise src.error(f"has a scale tensor ({scale.key!r}) but {p.target!r} holds integers")
    allowed, want = _scale_format(p, shape, block)
    if scale.dtype not in allowed:
        raise scale.error(f"scale dtype {scale.dtype} for a {src.dtype} weight must be one of "
                          f"{', '.join(map(str, allowed))}")
    if scale.shape != want:
        raise scale.error(f"scale shape {scale.shape} != expected {want} for weight shape "
                          f"{src.shape}" + (f" (FP8 block {block})" if src.dtype == torch.float8_e4m3fn else ""))


def _check_unscaled(p: Placement, integer_target: bool) -> None:
    """A stored tensor without a scale: plain integer or float data (FP8 needs its scale)."""
    src = p.source
    if src.dtype == torch.float8_e4m3fn:
        raise src.error("FP8 weight without a scale tensor (….scale or ….weight_scale_inv)")
    if integer_target and src.dtype not in INTEGERS:
        raise src.error(f"dtype {src.dtype} where integer data is expected "
                        f"({', '.join(map(str, INTEGERS))})")
    if not integer_target and src.dtype not in FLOATS and not (p.mode == DRAFT and src.dtype in INTEGERS):
        raise src.error(f"dtype {src.dtype} where float data is expected "
                        f"({', '.join(map(str, FLOATS))}, or FP8 / MXFP4 with a scale)")


def _scale_format(p: Placement, shape: tuple[int, ...], block: int) -> tuple[tuple[torch.dtype, ...], tuple[int, ...]]:
    """(the scale dtypes allowed, the scale shape expected) of a scaled stored tensor of `shape` values."""
    src = p.source
    allowed: tuple[torch.dtype, ...]
    if src.dtype == torch.float8_e4m3fn and p.target.endswith(ENGRAM_TABLE):
        allowed, want = TABLE_SCALES, shape[:-1] + (shape[-1] // 32,)       # one e8m0 per row and 32 channels
    elif src.dtype == torch.float8_e4m3fn:
        allowed, want = FP8_SCALES, _blocks(shape, block)
    elif src.dtype in PACKED_FP4:
        if shape[-1] % 32:
            raise src.error(f"MXFP4 needs a multiple of 32 values per row, got {shape[-1]}")
        allowed, want = FP4_SCALES, shape[:-1] + (shape[-1] // 32,)
    else:
        raise src.error(f"has a scale tensor but dtype {src.dtype} is neither FP8 (e4m3) "
                        f"nor packed FP4 (int8 / uint8)")
    return allowed, want


def _blocks(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    return shape[:-2] + tuple(-(-d // block) for d in shape[-2:])
