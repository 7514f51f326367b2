"""EngineArgs.load_format and `deepinfer bench --load-format dummy` on a folder holding only config.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from engine_tiny_v4 import CONFIG

import deepinfer.model
from deepinfer.engine import EngineArgs, InvalidEngineArgs, LLMEngine, SamplingParams
from deepinfer.engine.cli import main
from deepinfer.engine.config.engine_args import LOAD_FORMATS, allowed_values


@pytest.fixture
def config_only(tmp_path: Path) -> Path:
    folder = tmp_path / "v4-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("value", ["pickle", "Dummy", "", None, 1])
def test_load_format_is_checked(value: object) -> None:
    with pytest.raises(InvalidEngineArgs, match=re.escape(
            f"load_format={value!r} must be one of 'safetensors', 'dummy'")) as caught:
        EngineArgs(load_format=value)  # type: ignore[arg-type]
    assert caught.value.field == "load_format"


def test_load_formats_are_the_model_loaders() -> None:
    assert EngineArgs().load_format == "safetensors" and EngineArgs(load_format="dummy").load_format == "dummy"
    assert LOAD_FORMATS == deepinfer.model.LOAD_FORMATS
    assert allowed_values("load_format") == "safetensors, dummy"


def test_bench_runs_a_dummy_model_from_config_json_alone(capsys: pytest.CaptureFixture[str],
                                                        config_only: Path) -> None:
    code, out, err = _run(capsys, "bench", "--load-format", "dummy", "--model", str(config_only),
                          "--num-prompts", "2", "--input-len", "8", "--output-len", "4")
    assert code == 0, err
    result = json.loads(out)
    assert (result["num_completed"], result["finish_reasons"], result["model"]) == (2, {"length": 2}, str(config_only))
    assert result["output_tokens_per_s"] > 0 and result["mean_tpot_ms"] is not None
    assert re.match(rf"loaded {re.escape(str(config_only))} in \d+\.\d\d s, \d+\.\d MiB of weights", err)
    assert sorted(p.name for p in config_only.iterdir()) == ["config.json"]


def test_without_load_format_a_config_only_folder_is_a_load_error(capsys: pytest.CaptureFixture[str],
                                                                  config_only: Path) -> None:
    assert _run(capsys, "bench", "--model", str(config_only), "--num-prompts", "1") == (
        1, "", f"deepinfer: error: {config_only}: no model.safetensors or model.safetensors.index.json\n")
    code, out, err = _run(capsys, "bench", "--load-format", "pickle", "--model", str(config_only))
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == ("deepinfer bench: error: argument --load-format: invalid choice: 'pickle' "
                                    "(choose from 'safetensors', 'dummy')")


def test_the_engine_seed_fixes_the_dummy_weights_and_so_the_outputs(config_only: Path) -> None:
    def engine(seed: int) -> LLMEngine:
        return LLMEngine(EngineArgs(model=str(config_only), load_format="dummy", seed=seed, max_num_seqs=2))

    first, again, other = engine(4), engine(4), engine(5)
    assert first.tokenizer is None and first.eos_token_ids == (1,)
    state, same, different = (e.model.state_dict() for e in (first, again, other))
    assert all(torch.equal(state[name], same[name]) for name in state)
    assert not torch.equal(state["embed.weight"], different["embed.weight"])
    with pytest.raises(ValueError, match="tokenizer"):
        first.add_request(None, "text needs a tokenizer")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def greedy(e: LLMEngine) -> list[int]:
        e.add_request("a", list(range(3, 15)), params)
        finished = []
        while e.has_unfinished_requests():
            finished += [out for out in e.step() if out.finished]
        return finished[0].outputs[0].token_ids

    outputs = [greedy(e) for e in (first, again, other)]
    assert outputs[0] == outputs[1] != outputs[2] and len(outputs[2]) == 6
