"""The defaults a GPU user expects (EngineArgs.resolved): "auto" device and dtype, 0.9 of the GPU for
weights + cache, and a model given as a Hugging Face repo id read from a prepared local cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from deepinfer.engine import EngineArgs, InvalidEngineArgs, LLMEngine, SamplingParams
from deepinfer.model import embedded_model_dir


def test_auto_on_a_cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = EngineArgs()
    assert (args.device, args.dtype, args.kv_cache_memory_mb, args.gpu_memory_utilization) == ("auto", "auto", None,
                                                                                                 None)
    with pytest.raises(ValueError, match="resolved"):
        _ = args.torch_dtype
    resolved = args.resolved()
    assert (resolved.device, resolved.dtype, resolved.kv_cache_memory_mb, resolved.gpu_memory_utilization) == (
        "cpu", "float32", 256.0, None)
    assert resolved.resolved() == resolved and resolved.torch_dtype is torch.float32


def _folder(tmp_path: Path, torch_dtype: str) -> str:
    path = tmp_path / torch_dtype
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "torch_dtype": torch_dtype}))
    return str(path)


def test_auto_on_a_cuda_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    resolved = EngineArgs().resolved()       # the embedded model's config says bfloat16
    assert (resolved.device, resolved.dtype, resolved.gpu_memory_utilization) == ("cuda", "bfloat16", 0.9)
    assert EngineArgs(model=_folder(tmp_path, "float16")).resolved().dtype == "float16"
    assert EngineArgs(model=_folder(tmp_path, "float32")).resolved().dtype == "bfloat16"
    # a cache size given either way wins over the GPU fraction
    assert EngineArgs(num_kv_blocks=100).resolved().gpu_memory_utilization is None
    assert EngineArgs(kv_cache_memory_mb=64).resolved().gpu_memory_utilization is None
    assert EngineArgs(gpu_memory_utilization=0.5).resolved().gpu_memory_utilization == 0.5
    explicit = EngineArgs(device="cuda:1", dtype="float32").resolved()
    assert (explicit.device, explicit.dtype) == ("cuda:1", "float32")
    assert EngineArgs(device="cpu").resolved().dtype == "float32"


def _hub_cache(tmp_path: Path) -> Path:
    """A Hugging Face cache holding acme/tiny (a copy of the embedded model) at revision main."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(embedded_model_dir(), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return cache


def test_a_repo_id_is_read_from_the_local_hugging_face_cache(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(_hub_cache(tmp_path)))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)      # the network is never asked
    args = EngineArgs(model="acme/tiny", device="cpu", dtype="float32")
    assert args.model == "acme/tiny"                       # construction only checks
    snapshot = Path(args.resolved().model)
    assert snapshot.parent.name == "snapshots" and (snapshot / "model.safetensors").is_file()
    params = SamplingParams(temperature=0, max_tokens=6)
    outputs = []
    for model in ("acme/tiny", None):
        engine = LLMEngine(EngineArgs(model=model, seed=0))
        engine.add_request("r", "def f(", params)
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
    assert outputs[0].outputs[0].text == outputs[1].outputs[0].text and len(outputs[0].outputs[0].token_ids) == 6
    with pytest.raises(InvalidEngineArgs, match="does not download") as caught:
        EngineArgs(model="acme/missing").resolved()
    assert caught.value.field == "model"
    with pytest.raises(InvalidEngineArgs, match="is not a folder"):     # a path stays a path
        LLMEngine(EngineArgs(model=str(tmp_path / "nope")))
