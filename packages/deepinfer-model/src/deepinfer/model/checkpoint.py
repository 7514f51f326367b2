"""A model folder's safetensors checkpoint, read lazily: which files, what each tensor is (dtype,
shape, file) from the headers alone, and then one tensor at a time from memory-mapped shards.

`safe_open` maps a file and hands out tensors that view the mapping; the pages a tensor touched
stay resident (as file-backed RSS) until the file is unmapped. `TensorReader` therefore reopens a
file before a read would take the bytes read through one handle past `REMAP_BYTES`, so a multi-GB
shard never becomes resident as a whole: what the loader holds is the tensor being placed (or a
window of small ones), not the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from .config import file_problem, read_json_object

REMAP_BYTES = 256 << 20          # reopen a file after this many bytes were read through one handle

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class WeightError(ValueError):
    """A missing, unexpected, mis-shaped, mis-typed or non-finite weight, or an unusable checkpoint
    file; the message names the tensor key and / or the file."""


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One tensor as a safetensors header describes it (nothing read yet)."""

    key: str                      # as stored
    path: Path                    # the file holding it
    dtype: torch.dtype
    shape: tuple[int, ...]
    order: int                    # position in the file (by data offset), for sequential reads

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize

    def where(self) -> str:
        return f"{self.key} (in {self.path})"

    def error(self, problem: str) -> WeightError:
        """A WeightError naming this tensor, its file and `problem`."""
        return WeightError(f"{self.key}: {problem} (in {self.path})")


def find_checkpoint(model_dir: str | Path) -> tuple[tuple[Path, ...], dict[str, str] | None]:
    """The safetensors files of a folder: `model.safetensors`, or the shards named by
    `model.safetensors.index.json` (returned with its weight map, key → file name)."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists() or index.is_symlink():
        weight_map = read_json_object(index, WeightError, what="").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightError(f"{index}: missing or empty 'weight_map' (an object: tensor key → shard file name)")
        bad = [k for k, v in weight_map.items() if not isinstance(v, str)]
        if bad:
            raise WeightError(f"{index}: weight_map[{bad[0]!r}]={weight_map[bad[0]]!r} must be a file name")
        files = []
        for name in sorted(set(weight_map.values())):
            if Path(name).name != name or not name.endswith(".safetensors"):
                raise WeightError(f"{index}: shard name {name!r} must be a plain *.safetensors file name")
            problem = file_problem(root / name)
            if problem is not None:
                raise WeightError(f"{index}: shard {name!r} {problem}")
            files.append(root / name)
        return tuple(files), weight_map
    single = root / "model.safetensors"
    problem = file_problem(single)
    if problem is None:
        return (single,), None
    if problem != "does not exist":
        raise WeightError(f"{single} {problem}")
    raise WeightError(f"{root}: no model.safetensors or model.safetensors.index.json")


def read_headers(model_dir: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of the folder's checkpoint by stored key, from the file headers only (each file
    is mapped, its header parsed and checked against the file's length, and unmapped)."""
    files, weight_map = find_checkpoint(model_dir)
    out: dict[str, StoredTensor] = {}
    for path in files:
        for tensor in _header(path):
            if tensor.key in out:
                raise WeightError(f"key {tensor.key!r} appears in both {out[tensor.key].path} and {path}")
            out[tensor.key] = tensor
    for key, name in (weight_map or {}).items():
        if key not in out or out[key].path.name != name:
            raise WeightError(f"{files[0].parent / 'model.safetensors.index.json'}: maps {key!r} to {name!r}, "
                              f"which has no such tensor")
    return out


def _header(path: Path) -> list[StoredTensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            described = [(key, f.get_slice(key)) for key in f.offset_keys()]
            infos = [(key, s.get_dtype(), tuple(s.get_shape())) for key, s in described]
    except (SafetensorError, OSError) as err:
        raise WeightError(f"{path}: not a readable safetensors file: {err}") from None
    out = []
    for order, (key, dtype, shape) in enumerate(infos):
        if dtype not in _DTYPES:
            raise WeightError(f"{key}: dtype {dtype} is not supported (one of {', '.join(_DTYPES)}) (in {path})")
        out.append(StoredTensor(key, path, _DTYPES[dtype], shape, order))
    return out


class TensorReader:
    """Reads tensors one at a time through `safe_open` (memory-mapped), keeping at most a
    `REMAP_BYTES` window of each file mapped; use as a context manager."""

    def __init__(self) -> None:
        self._handles: dict[Path, Any] = {}   # safetensors' safe_open handles
        self._read_bytes: dict[Path, int] = {}

    def read(self, tensor: StoredTensor) -> Tensor:
        """The tensor's data (on CPU, a view of the mapped file: do not write to it)."""
        already = self._read_bytes.get(tensor.path, 0)
        if already and already + tensor.nbytes > REMAP_BYTES:
            self._close(tensor.path)              # at most max(REMAP_BYTES, this tensor) stays mapped
        try:
            handle = self._handles.get(tensor.path)
            if handle is None:
                handle = self._handles[tensor.path] = safe_open(str(tensor.path), framework="pt")
                self._read_bytes[tensor.path] = 0
            data = handle.get_tensor(tensor.key)
        except (SafetensorError, OSError) as err:
            raise tensor.error(f"cannot be read: {err}") from None
        self._read_bytes[tensor.path] += tensor.nbytes
        if data.dtype != tensor.dtype or tuple(data.shape) != tensor.shape:
            raise tensor.error("changed while loading (file rewritten?)")
        return data

    def close_all(self) -> None:
        for path in list(self._handles):
            self._close(path)

    def _close(self, path: Path) -> None:
        self._handles.pop(path, None)        # unmapped once the tensors it handed out are gone too

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close_all()
