"""The embedded default model: shipped inside the installed package, loadable by `load_model`, with
every DeepSeek-V4 mechanism live, and clearly better than a unigram model on held-out text."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Tokenizer

import deepinfer.model
from deepinfer.model import DeepseekV4ForCausalLM, ForwardBatch, ModelCache, load_model
from deepinfer.model.embedded import embedded_model_dir

SHIPPED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
           "README.md", "loss.png", "training_log.json", "heldout_sample.txt")
CONTEXT_LEN = 512
SAMPLE_WINDOWS = 4                 # 4 x 512 scored tokens of heldout_sample.txt
MARGIN_NATS = 1.5                  # model loss must beat the sample's own unigram entropy by this much
EXPECTED_SAMPLE_LOSS = 3.10487     # tools/train_tiny/evaluate.py on the shipped weights, 2026-11-29
BLOCK_SIZE = 16
PACKAGE_SOURCE = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This model's ops are tiny: one intra-op thread is as fast, and does not stall on a busy CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> DeepseekV4ForCausalLM:
    return load_model(embedded_model_dir())


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(embedded_model_dir() / "tokenizer.json"))


def _config() -> dict:
    return json.loads((embedded_model_dir() / "config.json").read_text(encoding="utf-8"))


def _installed_path(relative: str) -> Path:
    """Where the installed distribution keeps `relative` (a path inside the wheel): from RECORD for a
    wheel install, from the editable install's .pth (the src folder it adds) otherwise."""
    dist = importlib.metadata.distribution("deepinfer-model")
    files = list(dist.files or ())
    for f in files:
        if f.as_posix() == relative:
            return Path(dist.locate_file(f)).resolve()
    pth = [f for f in files if f.suffix == ".pth"]
    assert pth, "deepinfer-model is installed neither from a wheel nor editable (.pth)"
    src = Path(dist.locate_file(pth[0])).read_text(encoding="utf-8").strip().splitlines()[0]
    return (Path(src) / relative).resolve()


def _prefill_logits(model: DeepseekV4ForCausalLM, ids: list[int]) -> torch.Tensor:
    cache = ModelCache.allocate(model.cache_spec(BLOCK_SIZE), len(ids) // BLOCK_SIZE + 2, 2)
    table = list(range(1, -(-len(ids) // BLOCK_SIZE) + 1))
    with torch.no_grad():
        return model(ForwardBatch.build([ids], [0], [table], [1], logits="all"), cache)


def test_embedded_dir_is_the_installed_package_data() -> None:
    folder = embedded_model_dir()
    assert folder == Path(deepinfer.model.__file__).parent / "embedded"
    assert folder.resolve() / "model.safetensors" == _installed_path("deepinfer/model/embedded/model.safetensors")
    for name in SHIPPED:
        assert (folder / name).is_file(), name
    assert (folder / "model.safetensors").stat().st_size <= 10_000_000


def test_wheel_ships_the_model_and_loads_from_it(tmp_path: Path, model: DeepseekV4ForCausalLM) -> None:
    if not (PACKAGE_SOURCE / "pyproject.toml").is_file():
        pytest.skip("the deepinfer-model source tree is not next to this test")
    wheel_builder = pytest.importorskip("hatchling.builders.wheel")
    wheel = Path(next(iter(wheel_builder.WheelBuilder(str(PACKAGE_SOURCE)).build(
        directory=str(tmp_path / "dist"), versions=["standard"]))))
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        for name in SHIPPED:
            shipped = hashlib.sha256(archive.read(f"deepinfer/model/embedded/{name}")).hexdigest()
            assert shipped == hashlib.sha256((embedded_model_dir() / name).read_bytes()).hexdigest(), name
        archive.extractall(site)
    probe = (
        "import sys, torch; sys.path.insert(0, sys.argv[1])\n"
        "from deepinfer.model import ForwardBatch, ModelCache, load_model\n"
        "from deepinfer.model.embedded import embedded_model_dir\n"
        "folder = embedded_model_dir(); assert str(folder).startswith(sys.argv[1]), folder\n"
        "m = load_model(folder)\n"
        "cache = ModelCache.allocate(m.cache_spec(16), 4, 2)\n"
        "out = m(ForwardBatch.build([list(range(8, 40))], [0], [[1, 2]], [1]), cache)\n"
        "print(out[0].argmax().item(), round(out[0].max().item(), 4))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", probe, str(site)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    logits = _prefill_logits(model, list(range(8, 40)))[-1]
    assert run.stdout.split() == [str(logits.argmax().item()), str(round(logits.max().item(), 4))]


def test_config_turns_every_mechanism_on(tokenizer: Tokenizer) -> None:
    raw = _config()
    cfg = deepinfer.model.DeepseekV4Config.from_dict(raw)
    assert set(cfg.attention_types) == {"sliding", "csa", "hca"}
    assert 1 <= cfg.num_hash_layers < cfg.num_hidden_layers          # hash-routed, then learned-routed
    assert cfg.n_shared_experts == 1 and cfg.num_experts_per_tok < cfg.n_routed_experts
    assert cfg.hc_mult >= 2
    csa_entries = CONTEXT_LEN // min(r for r in cfg.compress_ratios if r)
    assert cfg.index_topk < csa_entries                                 # the indexer really selects
    assert cfg.sliding_window < CONTEXT_LEN
    assert cfg.dspark_block_size == 5 and cfg.dspark_markov_rank == 32
    assert all(0 <= i < cfg.num_hidden_layers for i in cfg.dspark_target_layer_ids)
    assert tokenizer.id_to_token(cfg.dspark_noise_token_id) == "<|noise|>"
    assert tokenizer.id_to_token(cfg.bos_token_id) == "<|bos|>"
    assert [tokenizer.id_to_token(i) for i in cfg.eos_token_id] == ["<|eos|>"]
    assert tokenizer.get_vocab_size() == cfg.vocab_size


def test_no_mechanism_is_left_at_its_inert_default() -> None:
    cfg = deepinfer.model.DeepseekV4Config.from_dict(_config())
    with safe_open(str(embedded_model_dir() / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tails = ("sinks", "position_bias", "attn_hc.base", "ffn_hc.base", "hc_head.hc_base", "e_score_correction_bias")
    for tail in tails:
        found = [k for k in tensors if k.endswith(tail)]
        assert found, tail
        for key in found:
            assert tensors[key].float().abs().max() > 1e-3, key
    table = tensors["model.layers.0.mlp.gate.tid2eid"]
    assert table.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
    assert (table[:, 0] != table[:, 1]).all() and int(table.min()) >= 0 and int(table.max()) < cfg.n_routed_experts
    assert len(torch.unique(table)) == cfg.n_routed_experts


def test_tokenizer_round_trips_the_heldout_sample(tokenizer: Tokenizer) -> None:
    text = (embedded_model_dir() / "heldout_sample.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text
    assert len(ids) + 1 > SAMPLE_WINDOWS * CONTEXT_LEN        # bos + sample covers every scored window


def test_heldout_loss_beats_the_unigram_baseline(model: DeepseekV4ForCausalLM, tokenizer: Tokenizer) -> None:
    text = (embedded_model_dir() / "heldout_sample.txt").read_text(encoding="utf-8")
    ids = [_config()["bos_token_id"]] + tokenizer.encode(text, add_special_tokens=False).ids
    total, targets = 0.0, []
    for w in range(SAMPLE_WINDOWS):
        chunk = ids[w * CONTEXT_LEN: (w + 1) * CONTEXT_LEN + 1]
        logits = _prefill_logits(model, chunk[:-1])
        total += F.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum").item()
        targets.extend(chunk[1:])
    loss = total / len(targets)
    # The best any unigram model can do on these targets, even one fitted to them: their own entropy.
    entropy = -sum(c / len(targets) * math.log(c / len(targets)) for c in Counter(targets).values())
    assert loss < entropy - MARGIN_NATS, (loss, entropy)
    assert loss == pytest.approx(EXPECTED_SAMPLE_LOSS, abs=5e-3)


def test_incremental_decode_matches_one_prefill(model: DeepseekV4ForCausalLM, tokenizer: Tokenizer) -> None:
    prompt = [0] + tokenizer.encode("import os\nimport sys\n\n\ndef main", add_special_tokens=False).ids
    cache = ModelCache.allocate(model.cache_spec(BLOCK_SIZE), 6, 2)
    steps, chunk, start, generated = [], prompt, 0, []
    with torch.no_grad():
        for _ in range(30):                  # crosses CSA (4) and HCA (16) compression boundaries
            logits = model(ForwardBatch.build([chunk], [start], [[1, 2, 3, 4]], [1]), cache)[0]
            steps.append(logits)
            start += len(chunk)
            chunk = [int(logits.argmax())]
            generated.append(chunk[0])
    full = _prefill_logits(model, prompt + generated[:-1])
    torch.testing.assert_close(torch.stack(steps), full[len(prompt) - 1:], atol=2e-4, rtol=1e-4)
    assert len(set(generated)) > 3           # a trained model does not repeat one token
