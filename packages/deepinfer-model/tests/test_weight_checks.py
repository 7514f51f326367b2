"""Weights that would load silently and generate garbage are refused as they load: non-finite values,
dtypes that do not suit the format, out-of-range hash-routing ids; and every unusable checkpoint file
is named with what is wrong with it (`WeightError`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from hf_twin import hf_model
from safetensors.torch import save_file

from deepinfer.kernels.reference import quant_fp8_block, quant_mxfp4
from deepinfer.model import WeightError, load_model

KV = "model.layers.1.self_attn.kv_proj.weight"            # [32, 64]
SCALE = "model.layers.1.self_attn.kv_proj.scale"
TID2EID = "model.layers.0.mlp.gate.tid2eid"               # [96, 2] int64, experts < 4


@pytest.fixture(scope="module")
def tiny() -> tuple[dict, dict[str, torch.Tensor]]:
    hf, raw = hf_model(seed=21)
    return raw, {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}


def _write(folder: Path, raw: dict, tensors: dict[str, torch.Tensor], **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**raw, **config}))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _fails(folder: Path, message: str, **kwargs) -> None:
    with pytest.raises(WeightError, match=message) as caught:
        load_model(folder, **kwargs)
    assert str(folder) in str(caught.value), str(caught.value)        # the file is named


def _index(weight_map: dict) -> bytes:
    return json.dumps({"weight_map": weight_map}).encode()


def _fp8_config() -> dict:
    return {"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_float_weight_names_key_and_file(tiny, tmp_path, bad: float) -> None:
    raw, state = tiny
    tensors = dict(state)
    tensors[KV] = state[KV].clone()
    tensors[KV][3, 5] = bad
    _fails(_write(tmp_path, raw, tensors), re.escape(KV) + r": 1 of 2048 value\(s\) are not finite")


def test_non_finite_bfloat16_weight_is_found(tiny, tmp_path) -> None:
    raw, state = tiny
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in state.items()}
    tensors["model.norm.weight"][7] = float("nan")
    _fails(_write(tmp_path, raw, tensors), r"model\.norm\.weight: 1 of 64 value\(s\) are not finite",
           dtype=torch.bfloat16)


def test_finite_weight_that_overflows_the_model_dtype(tiny, tmp_path) -> None:
    raw, state = tiny
    tensors = {**state, KV: state[KV].clone()}
    tensors[KV][0, 0] = 1e6                                   # fine in float32, inf in float16
    folder = _write(tmp_path, raw, tensors)
    load_model(folder)
    _fails(folder, re.escape(KV) + r": finite in the checkpoint but overflows torch.float16", dtype=torch.float16)


def test_nan_in_an_fp8_weight_or_its_scale(tiny, tmp_path) -> None:
    raw, state = tiny
    q, s = quant_fp8_block(state[KV], 16)
    codes = q.view(torch.uint8).clone()
    codes[1, 2] = 0x7F                                        # e4m3fn NaN
    tensors = {**state, KV: codes.view(torch.float8_e4m3fn), KV.replace("weight", "weight_scale_inv"): s}
    _fails(_write(tmp_path / "a", raw, tensors, **_fp8_config()),
           re.escape(KV) + r": 1 of 2048 value\(s\) are not finite \(NaN or inf\) \(dequantised with "
           + re.escape(KV.replace("weight", "weight_scale_inv")))
    e8m0 = torch.full(s.shape, 127, dtype=torch.uint8)
    e8m0[0, 1] = 0xFF                                          # e8m0 NaN
    tensors = {**state, KV: q, SCALE: e8m0.view(torch.float8_e8m0fnu)}
    _fails(_write(tmp_path / "b", raw, tensors, **_fp8_config()), re.escape(KV) + r": 256 of 2048 value\(s\)")


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({KV: torch.ones(32, 64, dtype=torch.int32)}, re.escape(KV) + r": dtype torch.int32 where float data is"),
        ({KV: torch.ones(32, 64, dtype=torch.bool)}, re.escape(KV) + r": dtype torch.bool where float data"),
        ({TID2EID: torch.zeros(96, 2)}, re.escape(TID2EID) + r": dtype torch.float32 where integer data is expected"),
        ({KV: torch.ones(32, 64).to(torch.float8_e4m3fn)}, re.escape(KV) + r": FP8 weight without a scale tensor"),
        ({SCALE: torch.ones(2, 4)},
         re.escape(KV) + r": has a scale tensor but dtype torch.float32 is neither FP8 \(e4m3\) nor packed FP4"),
        ({KV: torch.ones(32, 64).to(torch.float8_e4m3fn), SCALE: torch.ones(2, 4, dtype=torch.int32)},
         re.escape(SCALE) + r": scale dtype torch.int32 for a torch.float8_e4m3fn weight must be"),
        ({KV: torch.ones(32, 64).to(torch.float8_e4m3fn), SCALE: torch.ones(4, 4)},
         r"scale shape \(4, 4\) != expected \(2, 4\) for weight shape \(32, 64\) \(FP8 block 16\)"),
        ({KV: torch.zeros(32, 32, dtype=torch.uint8), SCALE: torch.ones(32, 2)},
         r"scale dtype torch.float32 for a torch.uint8 weight must be one of torch.float8_e8m0fnu, torch.uint8"),
        ({KV: torch.zeros(32, 31, dtype=torch.uint8), SCALE: torch.ones(32, 2, dtype=torch.uint8)},
         re.escape(KV) + r": shape \(32, 31\) \(packed FP4: two values per byte\) != expected \(32, 64\)"),
        ({TID2EID: torch.zeros(96, 2, dtype=torch.int64), TID2EID + "_scale": torch.ones(1)},
         r"unexpected weight\(s\): " + re.escape(TID2EID + "_scale")),
    ],
)
def test_dtypes_that_do_not_suit_the_format_are_refused_before_reading(tiny, tmp_path, tensors, message) -> None:
    raw, state = tiny
    _fails(_write(tmp_path, raw, {**state, **tensors}, **_fp8_config()), message)


def test_hash_routing_ids_out_of_range(tiny, tmp_path) -> None:
    raw, state = tiny
    table = state[TID2EID].clone()
    table[10, 1] = 4                                          # n_routed_experts = 4
    _fails(_write(tmp_path, raw, {**state, TID2EID: table}),
           re.escape(TID2EID) + r": expert id 4 out of range \[0, 4\)")
    table[10, 1] = -1
    _fails(_write(tmp_path, raw, {**state, TID2EID: table.to(torch.int32)}), r"expert id -1 out of range")


def _per_expert(state: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """The stacked experts of one layer as official per-expert keys (with save_pretrained's prefix)."""
    up = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
    down = state[f"model.layers.{layer}.mlp.experts.down_proj"]
    inter, out = up.shape[1] // 2, {}
    for e in range(up.shape[0]):
        prefix = f"model.layers.{layer}.ffn.experts.{e}"
        out[f"{prefix}.w1.weight"], out[f"{prefix}.w3.weight"] = up[e, :inter].clone(), up[e, inter:].clone()
        out[f"{prefix}.w2.weight"] = down[e].clone()
    return out


def test_experts_given_twice_missing_or_out_of_range(tiny, tmp_path) -> None:
    raw, state = tiny
    per_expert = _per_expert(state, 2)
    _fails(_write(tmp_path / "twice", raw, {**state, **per_expert}),
           r"'layers\.2\.ffn\.experts\.w(13|2)' is given twice: by model\.layers\.2\.")
    stacked_gone = {k: v for k, v in state.items() if ".layers.2.mlp.experts." not in k}
    del per_expert["model.layers.2.ffn.experts.1.w3.weight"]
    _fails(_write(tmp_path / "missing", raw, {**stacked_gone, **per_expert}),
           r"missing weight 'layers\.2\.ffn\.experts\.1\.w3\.weight' \(expected shape \(48, 64\)")
    per_expert["model.layers.2.ffn.experts.1.w3.weight"] = torch.zeros(48, 64)
    per_expert["model.layers.2.ffn.experts.4.w3.weight"] = torch.zeros(48, 64)
    _fails(_write(tmp_path / "range", raw, {**stacked_gone, **per_expert}),
           r"experts\.4\.w3\.weight: expert id 4 out of range \(n_routed_experts=4\)")


def test_kept_fp8_and_mxfp4_experts_are_checked_for_nan_codes(tmp_path) -> None:
    hf, raw = hf_model(seed=22, moe_intermediate_size=64)          # MXFP4 groups of 32 divide 64
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    per_expert = _per_expert(state, 1)
    stacked_gone = {k: v for k, v in state.items() if ".layers.1.mlp.experts." not in k}
    fp8 = {}
    for key, w in per_expert.items():
        fp8[key], fp8[key.replace("weight", "scale")] = quant_fp8_block(w, 16)
    bad = fp8["model.layers.1.ffn.experts.2.w2.weight"].view(torch.uint8).clone()
    bad[0, 0] = 0xFF
    fp8["model.layers.1.ffn.experts.2.w2.weight"] = bad.view(torch.float8_e4m3fn)
    _fails(_write(tmp_path / "fp8", raw, {**stacked_gone, **fp8}, **_fp8_config()),
           r"experts\.2\.w2\.weight: 1 NaN code\(s\) in FP8 data", expert_dtype="fp8")
    fp4 = {}
    for key, w in per_expert.items():
        packed, scale = quant_mxfp4(w)
        fp4[key], fp4[key.replace("weight", "scale")] = packed, scale.view(torch.float8_e8m0fnu)
    bad_scale = fp4["model.layers.1.ffn.experts.0.w1.scale"].view(torch.uint8).clone()
    bad_scale[5, 0] = 0xFF
    fp4["model.layers.1.ffn.experts.0.w1.scale"] = bad_scale
    _fails(_write(tmp_path / "fp4", raw, {**stacked_gone, **fp4}),
           r"experts\.0\.w1\.scale: NaN \(0xFF\) e8m0 scale byte\(s\)", expert_dtype="fp4")


def test_bad_safetensors_files_are_named(tiny, tmp_path) -> None:
    raw, state = tiny
    folder = _write(tmp_path / "trunc", raw, state)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-100])
    _fails(folder, re.escape(str(folder / "model.safetensors")) + r": not a readable safetensors file: .*not fully")
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    _fails(folder, r"model\.safetensors: not a readable safetensors file: .*header too large")
    (folder / "model.safetensors").write_bytes(b"")
    _fails(folder, r"model\.safetensors: not a readable safetensors file: .*header too small")
    save_file({**state, KV: state[KV].to(torch.float8_e5m2)}, str(folder / "model.safetensors"))
    _fails(folder, re.escape(KV) + r": dtype F8_E5M2 is not supported")


def test_bad_index_files_are_named(tiny, tmp_path) -> None:
    raw, state = tiny
    folder = tmp_path
    (folder / "config.json").write_text(json.dumps(raw))
    keys = sorted(state)
    save_file({k: state[k] for k in keys[:20]}, str(folder / "a.safetensors"))
    save_file({k: state[k] for k in keys[20:]}, str(folder / "b.safetensors"))
    index = folder / "model.safetensors.index.json"
    weight_map = {k: "a.safetensors" if i < 20 else "b.safetensors" for i, k in enumerate(keys)}
    index.write_text(json.dumps({"weight_map": weight_map}))
    load_model(folder)
    cases = [
        (b"{", r"index\.json: not valid JSON"),
        (b'{"weight_map": {"k": "\xe9.safetensors"}}', r"index\.json: not UTF-8 text"),
        (b"[]", r"index\.json: must hold a JSON object, got a JSON array"),
        (json.dumps({"metadata": {}}).encode(), r"index\.json: missing or empty 'weight_map'"),
        (_index({**weight_map, KV: 3}), r"weight_map\['" + re.escape(KV) + r"'\]=3 must be a file name"),
        (_index({**weight_map, KV: "../a.safetensors"}), r"shard name '\.\./a\.safetensors' must be a plain"),
        (_index({**weight_map, KV: "c.safetensors"}), r"shard 'c\.safetensors' does not exist"),
        (_index({**weight_map, "extra.weight": "a.safetensors"}),
         r"index\.json: maps 'extra\.weight' to 'a\.safetensors', which has no such tensor"),
    ]
    for content, message in cases:
        index.write_bytes(content)
        _fails(folder, message)
    index.write_text(json.dumps({"weight_map": weight_map}))
    save_file({k: state[k] for k in keys[19:]}, str(folder / "b.safetensors"))
    _fails(folder, r"key '" + re.escape(keys[19]) + r"' appears in both .*a\.safetensors and .*b\.safetensors")
