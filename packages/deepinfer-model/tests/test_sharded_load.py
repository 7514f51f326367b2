"""Loading one expert-parallel rank's experts only (`load_model(..., local_experts=...)`): the same
expert rows as loading everything and sharding afterwards, from stacked and per-expert checkpoints,
float and quantised, with redundant slots; the same logits once the EP exchange is attached."""

from __future__ import annotations

import json
import re
import shutil
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from deepinfer.kernels import kernels_for
from deepinfer.model import (
    ExpertSlots,
    ForwardBatch,
    ModelCache,
    WeightError,
    apply_expert_parallel,
    embedded_model_dir,
    load_model,
    moe_layers,
)

# per MoE layer of the embedded model (6 layers, 8 experts): this rank's slots, with repeats
LOCAL = [[3, 0, 3], [7, 1, 2], [5, 5, 4], [0, 6, 2], [1, 7, 6], [2, 4, 0]]
EXPERT_KEY = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(w13|w2)$")


def _copy_folder(src, dst) -> None:
    dst.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    """The embedded model's folder (transformers' stacked names, float experts), the same weights
    with one official-style tensor per expert and matrix, and a folder of FP8 experts as this model
    keeps them (stacked, with block scales: loaded as stored)."""
    src = embedded_model_dir()
    root = tmp_path_factory.mktemp("sharded")
    whole = load_model(src)
    per_expert, fp8 = root / "per_expert", root / "fp8"
    _copy_folder(src, per_expert)
    tensors = {}
    for key, t in whole.state_dict().items():
        hit = EXPERT_KEY.match(key)
        if hit is None:
            tensors[key] = t.contiguous()
            continue
        prefix, which = hit.groups()
        inter = t.shape[1] // 2
        for e in range(t.shape[0]):
            if which == "w2":
                tensors[f"{prefix}.{e}.w2.weight"] = t[e].contiguous()
            else:
                tensors[f"{prefix}.{e}.w1.weight"] = t[e, :inter].contiguous()
                tensors[f"{prefix}.{e}.w3.weight"] = t[e, inter:].contiguous()
    save_file(tensors, per_expert / "model.safetensors")
    _copy_folder(src, fp8)
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}     # FP8 experts' block
    for folder in (per_expert, fp8):
        (folder / "config.json").write_text(json.dumps(raw))
    model = load_model(per_expert, expert_dtype="fp8")
    save_file({k: t.contiguous() for k, t in model.state_dict().items()}, fp8 / "model.safetensors")
    return {"stacked": src, "per_expert": per_expert, "fp8_stored": fp8}


CASES = [("stacked", None), ("stacked", "fp4"), ("per_expert", None), ("per_expert", "fp8"), ("fp8_stored", "fp8")]


@pytest.mark.parametrize(("folder", "expert_dtype"), CASES)
def test_sharded_load_keeps_the_local_rows_of_a_whole_load(folders, folder: str, expert_dtype: str | None) -> None:
    whole = load_model(folders[folder], expert_dtype=expert_dtype)
    sharded = load_model(folders[folder], expert_dtype=expert_dtype, local_experts=LOCAL)
    whole_moes, sharded_moes = moe_layers(whole), moe_layers(sharded)
    for ids, full, local in zip(LOCAL, whole_moes, sharded_moes):
        index = torch.tensor(ids)
        for name in full.experts.param_names:
            want = getattr(full.experts, name).index_select(0, index)
            assert torch.equal(getattr(local.experts, name), want), name
    expert_names = {f"{n}." for n, m in sharded.named_modules() if m in {moe.experts for moe in sharded_moes}}
    whole_state = whole.state_dict()
    for key, t in sharded.state_dict().items():
        if not any(key.startswith(prefix) for prefix in expert_names):
            assert torch.equal(t, whole_state[key]), key


def test_only_the_local_experts_are_allocated(folders) -> None:
    sharded = load_model(folders["per_expert"], local_experts=LOCAL)
    assert [moe.experts.w13.shape[0] for moe in moe_layers(sharded)] == [3] * len(LOCAL)


def test_a_missing_expert_fails_only_the_rank_that_holds_it(folders, tmp_path) -> None:
    folder = tmp_path / "missing"
    _copy_folder(folders["per_expert"], folder)
    from safetensors.torch import load_file
    tensors = load_file(folders["per_expert"] / "model.safetensors")
    del tensors["layers.0.ffn.experts.5.w2.weight"]
    save_file(tensors, folder / "model.safetensors")
    load_model(folder, local_experts=LOCAL)                     # layer 0 holds 3 and 0 here
    holder = [[5, 0, 3], *LOCAL[1:]]
    with pytest.raises(WeightError, match=r"layers\.0\.ffn\.experts\.5\.w2"):
        load_model(folder, local_experts=holder)


@pytest.mark.parametrize(("local", "message"), [
    (LOCAL[:-1], "5 layers; the model has 6"),
    ([[0, 8], *LOCAL[1:]], r"local_experts\[0\].*\[0, 8\)"),
    ([[], *LOCAL[1:]], r"local_experts\[0\]"),
])
def test_bad_local_experts_are_refused(folders, local, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_model(folders["stacked"], local_experts=local)


def test_sharded_load_refuses_the_dummy_format(folders) -> None:
    with pytest.raises(ValueError, match="safetensors format only"):
        load_model(folders["stacked"], load_format="dummy", local_experts=LOCAL)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sharded_model_with_the_exchange_gives_the_whole_models_logits(folders) -> None:
    """One EP rank holding every expert, in a shuffled order with two redundant slots per layer:
    the routing must reach each expert through its slots."""
    order = [[7, 6, 5, 4, 3, 2, 1, 0, 3, 6], [0, 2, 4, 6, 1, 3, 5, 7, 0, 0]] * 3
    whole = load_model(folders["per_expert"])
    sharded = load_model(folders["per_expert"], local_experts=order)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        apply_expert_parallel(sharded, dist.group.WORLD, [ExpertSlots(torch.tensor(ids), 8, 1) for ids in order],
                              loaded_sharded=True)
        ops = kernels_for(torch.device("cpu"))
        tokens = [[11, 42, 7, 99, 5, 63, 17, 2, 80, 31]]
        logits = []
        for model in (whole, sharded):
            cache = ModelCache.allocate(model.cache_spec(64), 3, 2)
            batch = ForwardBatch.build(tokens, [0], [[1]], [1], logits="all", device=torch.device("cpu"))
            with torch.no_grad():
                logits.append(model(batch, cache, ops))
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="loaded with 10 expert slots"):
            apply_expert_parallel(sharded, dist.group.WORLD, [ExpertSlots(torch.arange(8), 8, 1)] * 6,
                                  loaded_sharded=True)
    finally:
        dist.destroy_process_group()
