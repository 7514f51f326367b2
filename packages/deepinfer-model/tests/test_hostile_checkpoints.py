"""Checkpoints and configs a hostile (or careless) user hands the loader (issue #36): each is refused with
an error naming the file or field and what is wrong, instead of loading silently, hanging or
failing with a raw OSError: a shard that is a symlink loop, a FIFO or a folder; a float16 / bfloat16
label swapped in a safetensors header; absurd config values."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from hf_twin import BASE, hf_model
from safetensors.torch import save_file

from deepinfer.model import ConfigError, DeepseekV4Config, WeightError, load_model

KV = "model.layers.1.self_attn.kv_proj.weight"


@pytest.fixture(scope="module")
def tiny() -> tuple[dict, dict[str, torch.Tensor]]:
    hf, raw = hf_model(seed=5)
    return raw, {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}


def _fails(folder: Path, message: str) -> None:
    with pytest.raises(WeightError, match=message):
        load_model(folder)


def _sharded(folder: Path, raw: dict, state: dict[str, torch.Tensor]) -> list[str]:
    """Two shards a / b and their index; returns the keys in b."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    keys = sorted(state)
    save_file({k: state[k] for k in keys[:20]}, str(folder / "a.safetensors"))
    save_file({k: state[k] for k in keys[20:]}, str(folder / "b.safetensors"))
    weight_map = {k: "a.safetensors" if i < 20 else "b.safetensors" for i, k in enumerate(keys)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return keys[20:]


def test_a_shard_that_is_not_a_readable_file_says_what_it_is(tiny, tmp_path: Path) -> None:
    raw, state = tiny
    folder = tmp_path / "m"
    _sharded(folder, raw, state)
    shard = folder / "b.safetensors"
    shard.unlink()
    cases = [
        (lambda: os.symlink(shard, shard), r"shard 'b\.safetensors' is a symlink loop"),
        (lambda: os.mkfifo(shard), r"shard 'b\.safetensors' is a FIFO \(named pipe\), not a file"),  # never opened
        (lambda: shard.mkdir(), r"shard 'b\.safetensors' is a directory, not a file"),
        (lambda: os.symlink(folder / "gone.safetensors", shard),
         r"shard 'b\.safetensors' is a symlink to '.*gone\.safetensors', which does not exist"),
        (lambda: None, r"shard 'b\.safetensors' does not exist"),
    ]
    for make, message in cases:
        make()
        _fails(folder, message)
        if shard.is_dir() and not shard.is_symlink():
            shard.rmdir()
        elif shard.is_symlink() or shard.exists():
            shard.unlink()
    single = tmp_path / "single"
    single.mkdir()
    (single / "config.json").write_text(json.dumps(raw))
    os.mkfifo(single / "model.safetensors")
    _fails(single, r"model\.safetensors is a FIFO")
    (single / "model.safetensors").unlink()
    os.symlink("config.json.loop", single / "config.json.loop")
    (single / "config.json").unlink()
    os.symlink(single / "config.json.loop", single / "config.json")
    with pytest.raises(ConfigError, match=r"config\.json is a symlink loop"):
        DeepseekV4Config.from_model_dir(single)


def _relabel(path: Path, key: str, dtype: str) -> None:
    """Rewrite `key`'s dtype in a safetensors header (same element size: the offsets stay right)."""
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    header[key]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    assert len(text) == size
    path.write_bytes(bytes(data[:8]) + text + bytes(data[8 + size:]))


@pytest.mark.parametrize("declared", [None, "bfloat16"])
def test_a_bfloat16_tensor_relabelled_float16_is_refused(tiny, tmp_path: Path, declared: str | None) -> None:
    raw, state = tiny
    config = {**raw, "torch_dtype": declared} if declared else {k: v for k, v in raw.items() if k != "torch_dtype"}
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    halves = {k: v.to(torch.bfloat16) if v.dtype == torch.float32 and v.dim() == 2 else v for k, v in state.items()}
    save_file(halves, str(tmp_path / "model.safetensors"))
    load_model(tmp_path)                                                    # consistent: loads
    _relabel(tmp_path / "model.safetensors", KV, "F16")
    basis = "config.json torch_dtype is torch.bfloat16" if declared else r"\d+ of its \d+ 16-bit float tensors"
    _fails(tmp_path, re.escape(KV) + r": dtype torch\.float16 in a checkpoint whose 16-bit floats are "
           r"torch\.bfloat16 \(" + basis)


@pytest.mark.parametrize(("override", "message"), [
    ({"hc_sinkhorn_iters": 10**9}, r"hc_sinkhorn_iters=1000000000 must be an integer in \[1, 1000\]"),
    ({"rms_norm_eps": 1e308}, r"rms_norm_eps=1e\+308 must be a finite number in \(0, 1\]"),
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps=nan must be a finite number"),
    ({"num_hidden_layers": -2}, r"num_hidden_layers=-2 must be an integer >= 1"),
    ({"vocab_size": 10**12}, r"vocab_size=1000000000000 must be an integer in \[1, "),
])
def test_absurd_config_values_are_refused_naming_the_field(override: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DeepseekV4Config.from_dict({**BASE, **override})


def test_header_offsets_past_the_file_are_named(tiny, tmp_path: Path) -> None:
    raw, state = tiny
    (tmp_path / "config.json").write_text(json.dumps(raw))
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    start, end = header[KV]["data_offsets"]
    header[KV]["data_offsets"] = [start + 10**9, end + 10**9]          # same length, far past the end
    text = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data[8 + size:]))
    _fails(tmp_path, re.escape(str(path)) + r": not a readable safetensors file")
