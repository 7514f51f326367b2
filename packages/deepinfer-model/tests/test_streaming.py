"""`load_model` streams: the headers are checked before any tensor is read, then one stored tensor
(with its scale) at a time is read from a memory-mapped shard and placed before the next is read,
through a bounded number of mappings; `progress=True` draws a bar on stderr."""

from __future__ import annotations

import json
import re
import weakref

import pytest
import torch
from hf_twin import hf_model
from safetensors.torch import save_file

from deepinfer.model import WeightError, checkpoint, load_model


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    hf, _ = hf_model(seed=31)
    folder = tmp_path_factory.mktemp("sharded")
    hf.save_pretrained(folder, max_shard_size="150KB")
    return hf, folder


class _Tracker:
    """Counts the source tensors `TensorReader.read` handed out that are still alive, and the
    `safe_open` handles that are still open."""

    def __init__(self, monkeypatch) -> None:
        self.live_tensors = self.max_live_tensors = self.reads = 0
        self.live_handles = self.max_live_handles = self.opens = 0
        original_read, original_open = checkpoint.TensorReader.read, checkpoint.safe_open

        def read(reader, tensor):
            data = original_read(reader, tensor)
            self.reads += 1
            self.live_tensors += 1
            self.max_live_tensors = max(self.max_live_tensors, self.live_tensors)
            weakref.finalize(data, self._tensor_freed)
            return data

        def safe_open(*args, **kwargs):
            handle = original_open(*args, **kwargs)
            self.opens += 1
            self.live_handles += 1
            self.max_live_handles = max(self.max_live_handles, self.live_handles)
            return _Handle(handle, self._handle_freed)

        monkeypatch.setattr(checkpoint.TensorReader, "read", read)
        monkeypatch.setattr(checkpoint, "safe_open", safe_open)

    def _tensor_freed(self) -> None:
        self.live_tensors -= 1

    def _handle_freed(self) -> None:
        self.live_handles -= 1


class _Handle:
    """A safe_open handle whose release is observed (the object itself cannot carry a weakref)."""

    def __init__(self, handle, on_free) -> None:
        self._handle = handle
        weakref.finalize(self, on_free)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)


def test_one_source_tensor_at_a_time_through_bounded_mappings(sharded, monkeypatch) -> None:
    hf, folder = sharded
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    num_files = len(set(weight_map.values()))
    monkeypatch.setattr(checkpoint, "REMAP_BYTES", 20_000)      # reopen a file every ~20 kB read
    tracker = _Tracker(monkeypatch)
    loaded = load_model(folder)
    assert tracker.reads == len(weight_map)                    # each stored tensor once
    assert tracker.max_live_tensors == 1                        # no scales here: one tensor in flight
    assert tracker.live_tensors == 0 and tracker.live_handles == 0
    assert tracker.max_live_handles == 1
    assert tracker.opens > num_files + 5                       # header pass + reopened windows
    want = hf.state_dict()["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(loaded.state_dict()["layers.2.ffn.experts.w13"], want)


def test_weight_and_scale_are_the_only_tensors_in_flight(tmp_path, monkeypatch) -> None:
    """FP8 weights with scales in another shard: at most the weight and its scale are alive."""
    from deepinfer.kernels.reference import quant_fp8_block

    hf, raw = hf_model(seed=32)
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    weights, scales = {}, {}
    for key in [k for k in state if re.search(r"self_attn\.(q_a_proj|kv_proj|o_b_proj)\.weight$", k)]:
        weights[key], scales[key.replace(".weight", ".weight_scale_inv")] = quant_fp8_block(state.pop(key), 16)
    (tmp_path / "config.json").write_text(json.dumps(
        {**raw, "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}))
    save_file({**state, **weights}, str(tmp_path / "a.safetensors"))
    save_file(scales, str(tmp_path / "b.safetensors"))
    weight_map = dict.fromkeys(list(state) + list(weights), "a.safetensors") | dict.fromkeys(scales, "b.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tracker = _Tracker(monkeypatch)
    loaded = load_model(tmp_path)
    assert tracker.reads == len(weight_map) and tracker.max_live_tensors == 2 and tracker.live_tensors == 0
    assert tracker.max_live_handles == 2 and tracker.live_handles == 0
    key = "model.layers.1.self_attn.kv_proj.weight"
    from deepinfer.kernels.reference import dequant_fp8_block

    want = dequant_fp8_block(weights[key], scales[key.replace(".weight", ".weight_scale_inv")], 16)
    assert torch.equal(loaded.state_dict()["layers.1.attn.wkv.weight"], want)


def test_headers_are_checked_before_any_tensor_is_read(tmp_path, monkeypatch) -> None:
    hf, raw = hf_model(seed=33)
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    state["model.norm.weight"] = torch.ones(65)                 # read last (sorted file order), mis-shaped
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(state, str(tmp_path / "model.safetensors"))
    tracker = _Tracker(monkeypatch)
    with pytest.raises(WeightError, match=r"model\.norm\.weight: shape \(65,\) != expected \(64,\)"):
        load_model(tmp_path)
    assert tracker.reads == 0


def test_own_stacked_quantised_experts_round_trip(tmp_path) -> None:
    """This model's own state dict with FP8 experts (stacked `experts.w13` + `experts.w13_scale`) loads
    back byte for byte with expert_dtype="fp8", and dequantised without it."""
    from deepinfer.kernels.reference import dequant_fp8_block

    hf, raw = hf_model(seed=34)
    raw = {**raw, "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "src" / "model.safetensors"))
    fp8 = load_model(tmp_path / "src", expert_dtype="fp8").state_dict()
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in fp8.items()}, str(tmp_path / "own" / "model.safetensors"))
    again = load_model(tmp_path / "own", expert_dtype="fp8").state_dict()
    for key, value in fp8.items():
        assert torch.equal(again[key].view(torch.uint8), value.view(torch.uint8)), key
    floats = load_model(tmp_path / "own").state_dict()
    w13, scale = fp8["layers.1.ffn.experts.w13"], fp8["layers.1.ffn.experts.w13_scale"]
    assert torch.equal(floats["layers.1.ffn.experts.w13"][2], dequant_fp8_block(w13[2], scale[2], 16))


def test_progress_bar_on_stderr_only_when_asked(sharded, capsys) -> None:
    _, folder = sharded
    load_model(folder)
    assert capsys.readouterr().err == ""
    load_model(folder, progress=True)
    err = capsys.readouterr().err
    assert "Loading weights" in err and "100%" in err and re.search(r"\(\d+ files\)", err)
