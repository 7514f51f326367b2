"""Speculative decoding on a tiny random DeepSeek-V4 (and V4.1) with a random two-stage DSpark head.

Random drafts are almost never accepted, so a speculative step mostly emits one token, but the
engine still drafts, verifies k + 1 positions per row, rolls rejected ones back and reuses the rings:
greedy tokens must equal plain greedy decoding token for token, with ZOS on and off, while long
prompts are prefilled in chunks, prompts arrive mid-decode and requests are aborted mid-run; every
block, slot and row is given back. The checkpoint is the dummy loader's model (a folder with only
config.json) plus the head's random `mtp.*` weights handed to the engine as the checkpoint's draft
weights. The V4.1 twin runs the same trace on a tiny V4.1 of every layer kind (`engine_tiny_v41`),
whose verify steps are its multi-token decode as V4's are.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from engine_tiny_v4 import CONFIG as DUMMY_CONFIG
from engine_tiny_v41 import CONFIG as V41_CONFIG
from test_zos_replay import Arrival, assert_nothing_left, replay

from deepinfer.engine import SamplingParams, llm_engine
from deepinfer.model import DSparkDraft
from deepinfer.spec import FixedVerifyPolicy

CONFIG = {**DUMMY_CONFIG, "max_position_embeddings": 512, "eos_token_id": 95, "dspark_block_size": 3,
          "dspark_noise_token_id": 94, "dspark_target_layer_ids": [1, 2], "dspark_markov_rank": 8}
ARGS = {"device": "cpu", "load_format": "dummy", "max_num_seqs": 6, "max_num_batched_tokens": 32,
        "kv_cache_memory_mb": 8, "max_model_len": 256}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v4-tiny-dspark")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


@pytest.fixture(scope="module")
def folder_v41(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v41-tiny-dspark")
    (path / "config.json").write_text(json.dumps(V41_CONFIG))
    return path


@pytest.fixture(scope="module")
def with_random_head():
    """The engine's loader, giving the dummy model a random two-stage draft head's `mtp.*` weights."""
    load = llm_engine.load_model

    def load_with_head(*args, **kwargs):
        model = load(*args, **kwargs)
        draft = DSparkDraft(model, 2)
        draft.init_weights(3, std=0.05)
        model.draft_weights = {key: value.detach().clone() for key, value in draft.state_dict().items()}
        return model

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_engine, "load_model", load_with_head)
        yield


def _prompt(seed: int, length: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": np.random.default_rng(seed).integers(0, 94, length).tolist()}


@pytest.mark.usefixtures("with_random_head")
def test_random_draft_heads_keep_greedy_tokens_under_chunked_prefill_aborts_and_zos(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    want = _greedy_with_and_without_drafts(folder)
    _greedy_with_steps_without_drafts(folder, want, monkeypatch)


@pytest.mark.usefixtures("with_random_head")
def test_v41_random_draft_heads_keep_greedy_tokens_under_chunked_prefill_aborts_and_zos(
        folder_v41: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    want = _greedy_with_and_without_drafts(folder_v41)
    _greedy_with_steps_without_drafts(folder_v41, want, monkeypatch)


def _greedy_with_steps_without_drafts(folder: Path, want: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #31: decode steps in which no row drafts (every third step drafts, here) run as plain steps
    (spec_step.py), eager and on the graph path (emulated), with ZOS on (rows in flight take their place
    on the device from what their speculative step emitted): the tokens stay plain greedy's."""
    calls = iter(range(10**6))
    monkeypatch.setattr(FixedVerifyPolicy, "query_lens", lambda self, seq_ids, seq_lens, max_query_len: np.full(
        len(seq_ids), max_query_len if next(calls) % 3 == 0 else 1, dtype=np.int32))
    # `replay` keeps one engine per arguments: a cache size of their own gives these two fresh ones
    for cache_mb, emulate in ((9, "0"), (10, "1")):
        monkeypatch.setenv("DEEPINFER_EMULATE_CUDA_GRAPHS", emulate)
        run = replay(True, _ARRIVALS, num_speculative_tokens=3, varlen_verify=False, model=str(folder),
                     **{**ARGS, "kv_cache_memory_mb": cache_mb})
        assert (run.engine.runner.graphs is not None) is (emulate == "1")
        assert run.results == want
        stats = run.engine.stats()
        assert 6 < stats.spec_verify_steps < run.steps_left_in_flight // 2, (stats, run.steps_left_in_flight)
        assert_nothing_left(run.engine)


_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
_ARRIVALS = (
    Arrival(0, "long", _prompt(1, 90), _GREEDY),                     # three chunks of 32
    Arrival(0, "short", _prompt(2, 5), _GREEDY),
    Arrival(2, "mid", _prompt(3, 50), _GREEDY),                      # arrives while others decode
    Arrival(3, "aborted", _prompt(4, 12), SamplingParams(temperature=0.0, max_tokens=30), abort_after=4),
    Arrival(6, "late-long", _prompt(5, 70), SamplingParams(temperature=0.0, max_tokens=9)),
    Arrival(6, "one", _prompt(6, 7), SamplingParams(temperature=0.0, max_tokens=1)),
)


def _greedy_with_and_without_drafts(folder: Path) -> dict:
    arrivals = _ARRIVALS
    args = {**ARGS, "model": str(folder)}
    want = replay(False, arrivals, **args).results
    for zos in (False, True):
        run = replay(zos, arrivals, num_speculative_tokens=3, varlen_verify=False, **args)
        assert run.engine.spec is not None and run.engine.spec.k == 3 and run.engine.zos is zos
        assert run.results == want
        stats = run.engine.stats()
        assert stats.spec_verify_steps > 20 and stats.spec_draft_tokens == 3 * stats.spec_verify_rows
        assert_nothing_left(run.engine)
    assert want["aborted"].finish_reason == "abort" and want["one"].finish_reason == "length"
    assert all(len(want[r].token_ids) == 24 for r in ("long", "short", "mid"))
    return want
