"""Loading safetensors checkpoints: transformers names, official names, sharding, FP8 and MXFP4."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hf_twin import Runner, hf_model, twin
from safetensors.torch import save_file

from deepinfer.model import WeightError, load_model

FP8_BLOCK = 24            # not a divisor of the dims: exercises partial edge blocks
FP8_KEYS = re.compile(r"\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|shared_experts\.w[123]\.weight$")
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.fixture(scope="module")
def tiny():
    hf, raw = hf_model(seed=3, moe_intermediate_size=64)
    raw = {**raw, "quantization_config": {"quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]},
           "expert_dtype": "fp4"}
    return hf, raw, twin(hf, raw)


def _write_config(path, raw) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise w [out, in] with power-of-two block scales: (e4m3 weight, e8m0 scale, dequantised)."""
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // FP8_BLOCK), -(-in_dim // FP8_BLOCK)
    scale = torch.empty(rows, cols)
    deq = torch.empty_like(w)
    q = torch.empty(out_dim, in_dim, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK]
            s = 2.0 ** torch.ceil(torch.log2(blk.abs().max() / 448.0)).item()
            qb = (blk / s).to(torch.float8_e4m3fn)
            q[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = qb
            deq[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = qb.float() * s
            scale[i, j] = s
    return q, scale.to(torch.float8_e8m0fnu), deq


def _mxfp4(shape: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP4 weight: (packed int8 [out, in/2], e8m0 scale [out, in/32], its float value)."""
    out_dim, in_dim = shape
    codes = torch.randint(0, 16, (out_dim, in_dim), generator=gen)
    exps = torch.randint(-9, -4, (out_dim, in_dim // 32), generator=gen)
    value = torch.empty(out_dim, in_dim)
    for i in range(out_dim):
        for j in range(in_dim):
            c = int(codes[i, j])
            mag = E2M1[c & 7] * 2.0 ** int(exps[i, j // 32])
            value[i, j] = -mag if c & 8 else mag
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu), value


def _official_checkpoint(model, gen):
    """Official-name tensors (per-expert, FP8 dense, MXFP4 experts) and the dequantised state."""
    tensors, deq_state = {}, {}
    for key, t in model.state_dict().items():
        t = t.detach().clone()
        m = re.match(r"(layers\.\d+\.ffn\.experts)\.(w13|w2)$", key)
        if m:
            prefix, which = m.groups()
            stacked = []
            for e in range(t.shape[0]):
                if which == "w13":
                    inter = t.shape[1] // 2
                    halves = []
                    for part in ("w1", "w3"):
                        packed, scale, value = _mxfp4((inter, t.shape[2]), gen)
                        tensors[f"{prefix}.{e}.{part}.weight"], tensors[f"{prefix}.{e}.{part}.scale"] = packed, scale
                        halves.append(value)
                    stacked.append(torch.cat(halves))
                else:
                    packed, scale, value = _mxfp4(tuple(t.shape[1:]), gen)
                    tensors[f"{prefix}.{e}.w2.weight"], tensors[f"{prefix}.{e}.w2.scale"] = packed, scale
                    stacked.append(value)
            deq_state[key] = torch.stack(stacked)
        elif FP8_KEYS.search(key):
            q, scale, value = _fp8(t)
            tensors[key], tensors[key[: -len("weight")] + "scale"] = q, scale
            deq_state[key] = value
        else:
            tensors[key] = t
            deq_state[key] = t
    return tensors, deq_state


def test_sharded_official_fp8_mxfp4_matches_dequantised_twin(tiny, tmp_path) -> None:
    hf, raw, ours = tiny
    tensors, deq_state = _official_checkpoint(ours, torch.Generator().manual_seed(0))
    tensors["mtp.0.enorm.weight"] = torch.ones(64)           # draft-head weights are kept aside
    keys = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00003.safetensors": keys[i::3] for i in range(3)}
    _write_config(tmp_path, raw)
    weight_map = {}
    for name, shard_keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in shard_keys}, str(tmp_path / name))
        weight_map.update({k: name for k in shard_keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_model(tmp_path)
    for key, value in deq_state.items():
        torch.testing.assert_close(loaded.state_dict()[key].float(), value.float(), atol=0, rtol=0, msg=key)
    assert set(loaded.draft_weights) == {"mtp.0.enorm.weight"}
    twin_model = type(ours)(ours.cfg)
    twin_model.load_state_dict(deq_state)
    ids = list(range(5, 40))
    torch.testing.assert_close(Runner(loaded).step({1: ids})[0], Runner(twin_model.eval()).step({1: ids})[0],
                               atol=0, rtol=0)


def test_transformers_names_single_file(tiny, tmp_path) -> None:
    hf, raw, ours = tiny
    _write_config(tmp_path, {k: v for k, v in raw.items() if k not in ("quantization_config", "expert_dtype")})
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path)
    ids = list(range(3, 30))
    torch.testing.assert_close(Runner(loaded).step({1: ids})[0], Runner(ours).step({1: ids})[0], atol=0, rtol=0)


def test_bfloat16_load_keeps_fp32_params(tiny, tmp_path) -> None:
    hf, raw, ours = tiny
    _write_config(tmp_path, {k: v for k, v in raw.items() if k not in ("quantization_config", "expert_dtype")})
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path, dtype=torch.bfloat16)
    assert loaded.layers[0].attn.wq_a.weight.dtype == torch.bfloat16
    assert loaded.layers[0].hc_attn_fn.dtype == torch.float32 and loaded.layers[1].attn.attn_sink.dtype == torch.float32
    assert loaded.layers[0].ffn.gate.tid2eid.dtype == torch.int64


def _save_state(path, raw, state) -> None:
    _write_config(path, {k: v for k, v in raw.items() if k not in ("quantization_config", "expert_dtype")})
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))


def test_missing_weight_names_key_and_shape(tiny, tmp_path) -> None:
    hf, raw, ours = tiny
    state = dict(ours.state_dict())
    del state["layers.2.attn.compressor.ape"]
    _save_state(tmp_path, raw, state)
    with pytest.raises(WeightError, match=r"layers\.2\.attn\.compressor\.ape.*\(8, 32\)"):
        load_model(tmp_path)


def test_misshaped_and_unexpected_weights(tiny, tmp_path) -> None:
    hf, raw, ours = tiny
    state = dict(ours.state_dict())
    state["layers.0.attn.wkv.weight"] = torch.zeros(31, 64)
    _save_state(tmp_path / "a", raw, state)
    with pytest.raises(WeightError, match=r"layers\.0\.attn\.wkv\.weight: shape \(31, 64\) != expected \(32, 64\)"):
        load_model(tmp_path / "a")
    state = {**ours.state_dict(), "layers.0.attn.surprise": torch.zeros(2)}
    _save_state(tmp_path / "b", raw, state)
    with pytest.raises(WeightError, match=r"unexpected weight\(s\): layers\.0\.attn\.surprise"):
        load_model(tmp_path / "b")


def test_only_safetensors_are_read(tiny, tmp_path) -> None:
    hf, raw, ours = tiny
    _write_config(tmp_path, raw)
    torch.save(ours.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(WeightError, match="no model.safetensors"):
        load_model(tmp_path)
    index = {"weight_map": {"embed.weight": "gone.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightError, match="shard 'gone.safetensors' does not exist"):
        load_model(tmp_path)


def _fp8_expert_config(raw: dict) -> dict:
    """`raw` with FP8 blocks of 16 (they divide hidden 64 and the intermediate size 48)."""
    return {**raw, "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}, "expert_dtype": "fp8"}


def _dequantised_experts_twin(model, w13, s13, w2, s2):
    """A float twin of `model` whose routed experts are the dequantised FP8 ones (per layer)."""
    from deepinfer.kernels.reference import dequant_fp8_block

    twin_model = type(model)(model.cfg)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(("w13_scale", "w2_scale"))}
    for key in list(state):
        m = re.match(r"(layers\.\d+\.ffn\.experts)\.(w13|w2)$", key)
        if m:
            q, s = (w13, s13) if m.group(2) == "w13" else (w2, s2)
            state[key] = torch.stack([dequant_fp8_block(q[key][e], s[key][e], 16) for e in range(q[key].shape[0])])
    twin_model.load_state_dict(state)
    return twin_model.eval()


def test_fp8_experts_stay_fp8_from_an_fp8_checkpoint(tmp_path) -> None:
    """Official per-expert FP8 weights with float32 block scales load unchanged (bytes and scales)
    with `expert_dtype="fp8"`, and the model computes what its dequantised twin does; without the
    flag the same checkpoint loads dequantised."""
    from deepinfer.kernels.reference import quant_fp8_block

    hf, raw = hf_model(seed=5)
    raw = _fp8_expert_config(raw)
    ours = twin(hf, raw)
    tensors, w13, s13, w2, s2 = {}, {}, {}, {}, {}
    for key, t in ours.state_dict().items():
        m = re.match(r"(layers\.\d+\.ffn\.experts)\.(w13|w2)$", key)
        if not m:
            tensors[key] = t.detach().clone()
            continue
        prefix, which = m.groups()
        qs, ss = [], []
        for e in range(t.shape[0]):
            half = t.shape[1] // 2
            parts = (("w1", t[e, :half]), ("w3", t[e, half:])) if which == "w13" else (("w2", t[e]),)
            q_e, s_e = [], []
            for name, w in parts:
                q, s = quant_fp8_block(w.detach(), 16)
                tensors[f"{prefix}.{e}.{name}.weight"], tensors[f"{prefix}.{e}.{name}.scale"] = q, s
                q_e.append(q)
                s_e.append(s)
            qs.append(torch.cat(q_e))
            ss.append(torch.cat(s_e))
        (w13 if which == "w13" else w2)[key] = torch.stack(qs)
        (s13 if which == "w13" else s2)[key] = torch.stack(ss)
    _write_config(tmp_path, raw)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))

    loaded = load_model(tmp_path, expert_dtype="fp8")
    state = loaded.state_dict()
    for key in w13:
        assert state[key].dtype == torch.float8_e4m3fn
        assert torch.equal(state[key].view(torch.uint8), w13[key].view(torch.uint8))
        assert torch.equal(state[key + "_scale"], s13[key])
    for key in w2:
        assert torch.equal(state[key].view(torch.uint8), w2[key].view(torch.uint8))
        assert torch.equal(state[key + "_scale"], s2[key])
    reference_twin = _dequantised_experts_twin(loaded, w13, s13, w2, s2)
    ids = list(range(4, 37))
    want = Runner(reference_twin).step({1: ids})[0]
    torch.testing.assert_close(Runner(loaded).step({1: ids})[0], want, atol=1e-5, rtol=0)
    torch.testing.assert_close(Runner(load_model(tmp_path)).step({1: ids})[0], want, atol=1e-5, rtol=0)


def test_fp8_experts_quantised_on_load_from_a_float_checkpoint(tmp_path) -> None:
    """A checkpoint with float experts (transformers names) loads with `expert_dtype="fp8"` as
    `quant_fp8_block` of each expert matrix; the bf16 model is built with FP8 experts too."""
    from deepinfer.kernels.reference import quant_fp8_block

    hf, raw = hf_model(seed=6)
    raw = _fp8_expert_config(raw)
    _write_config(tmp_path, raw)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path, expert_dtype="fp8")
    ours = twin(hf, raw)
    w13, s13, w2, s2 = {}, {}, {}, {}
    for key, t in ours.state_dict().items():
        if re.search(r"\.experts\.(w13|w2)$", key):
            pairs = [quant_fp8_block(t[e].detach(), 16) for e in range(t.shape[0])]
            q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
            (w13 if key.endswith("w13") else w2)[key], (s13 if key.endswith("w13") else s2)[key] = q, s
            assert torch.equal(loaded.state_dict()[key].view(torch.uint8), q.view(torch.uint8))
    ids = list(range(2, 30))
    torch.testing.assert_close(Runner(loaded).step({1: ids})[0],
                               Runner(_dequantised_experts_twin(loaded, w13, s13, w2, s2)).step({1: ids})[0],
                               atol=1e-5, rtol=0)
    bf16 = load_model(tmp_path, expert_dtype="fp8", dtype=torch.bfloat16)
    assert bf16.layers[1].ffn.experts.w13.dtype == torch.float8_e4m3fn
    assert bf16.layers[1].ffn.experts.w13_scale.dtype == torch.float32


def test_mxfp4_experts_stay_mxfp4_from_an_official_checkpoint(tiny, tmp_path) -> None:
    """The official checkpoint's MXFP4 experts load byte for byte with `expert_dtype="fp4"` (e8m0
    scales as uint8) and compute what the dequantising load computes; float experts are quantised
    (`quant_mxfp4`)."""
    from deepinfer.kernels.reference import quant_mxfp4

    hf, raw, ours = tiny
    tensors, _ = _official_checkpoint(ours, torch.Generator().manual_seed(1))
    _write_config(tmp_path, raw)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path, expert_dtype="fp4")
    state = loaded.state_dict()
    for layer in range(len(loaded.layers)):
        prefix = f"layers.{layer}.ffn.experts"
        want = torch.stack([torch.cat([tensors[f"{prefix}.{e}.{w}.weight"] for w in ("w1", "w3")])
                            for e in range(loaded.cfg.n_routed_experts)])
        assert state[f"{prefix}.w13"].dtype == torch.uint8
        assert torch.equal(state[f"{prefix}.w13"], want.view(torch.uint8))
        scales = torch.stack([tensors[f"{prefix}.{e}.w2.scale"] for e in range(loaded.cfg.n_routed_experts)])
        assert torch.equal(state[f"{prefix}.w2_scale"], scales.view(torch.uint8))
    ids = list(range(5, 31))
    torch.testing.assert_close(Runner(loaded).step({1: ids})[0], Runner(load_model(tmp_path)).step({1: ids})[0],
                               atol=1e-5, rtol=0)

    float_dir = tmp_path / "float"
    _write_config(float_dir, raw)
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(float_dir / "model.safetensors"))
    quantised = load_model(float_dir, expert_dtype="fp4").state_dict()
    w2 = ours.state_dict()["layers.0.ffn.experts.w2"]
    packed, scale = quant_mxfp4(w2[1])
    assert torch.equal(quantised["layers.0.ffn.experts.w2"][1], packed)
    assert torch.equal(quantised["layers.0.ffn.experts.w2_scale"][1], scale)
