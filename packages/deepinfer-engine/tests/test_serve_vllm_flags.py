"""`deepinfer serve` takes vLLM users' habits: a positional MODEL, --revision of a cached repo id,
--tokenizer / --trust-remote-code / --tensor-parallel-size accepted or refused with a message saying
why, --enable-log-requests; its own defaults shown in --help. The server is not started: the
command's hand-off to `serve_client` is replaced by a recorder."""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest

import deepinfer.engine.cli as cli
import deepinfer.engine.serve as serve
from deepinfer.model import embedded_model_dir

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> dict:
    """What `deepinfer serve` would start: its EngineArgs and ServeOptions."""
    seen: dict = {}

    def start(args, max_num_waiting):
        seen["args"] = args
        return "llm"

    def serve_client(llm, options):
        seen["options"] = options
        return serve.ServeEnd(None, 0)

    monkeypatch.setattr(cli, "_start_engine_process", start)
    monkeypatch.setattr(serve, "serve_client", serve_client)
    return seen


def test_positional_model_and_the_flags_that_take_it(started: dict, capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(embedded_model_dir())
    assert cli.main(["serve", folder, "--tokenizer", folder, "--trust-remote-code", "--tensor-parallel-size", "1",
                     "--enable-log-requests"]) == 0
    args, options = started["args"], started["options"]
    assert args.model == folder and args.stop_preempted_request is False       # serve recomputes by default
    assert options.served_model_name == folder and options.enable_log_requests is True
    err = capsys.readouterr().err
    assert "--trust-remote-code has no effect: DeepInfer never runs code from a model folder" in err
    assert "deepinfer serve: stopped cleanly" in err
    assert cli.main(["serve", folder, "--model", folder]) == 0                  # the same model twice is fine


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "a/b", "--model", "c/d"], "argument MODEL: 'a/b' and --model 'c/d' name different models"),
    (["serve", "--tensor-parallel-size", "2"], "argument --tensor-parallel-size: 2 is not supported (only 1): "
     "DeepInfer spreads a model over GPUs with data-parallel attention and expert-parallel MoE, "
     "--data-parallel-size N --expert-parallel"),
    (["serve", "--tokenizer", "other/tok"], "argument --tokenizer: 'other/tok' is not MODEL (the embedded model): "
     "DeepInfer reads the tokenizer from the model folder"),
    (["serve", "--revision", "v1"], "argument --revision: applies to a Hugging Face repo id in the local cache, "
     "not to the embedded model"),
    (["serve", str(embedded_model_dir()), "--revision", "v1"], "not to the folder"),
])
def test_what_does_not_apply_is_a_usage_error_saying_why(started: dict, capsys: pytest.CaptureFixture[str],
                                                          argv: list[str], message: str) -> None:
    assert cli.main(argv) == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not started


def test_revision_picks_the_cached_snapshot(started: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "hub" / "models--acme--tiny"
    shutil.copytree(embedded_model_dir(), repo / "snapshots" / COMMIT, ignore=shutil.ignore_patterns("*.safetensors"))
    (repo / "refs").mkdir()
    (repo / "refs" / "v1").write_text(COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert cli.main(["serve", "acme/tiny", "--revision", "v1"]) == 0
    assert Path(started["args"].model) == repo / "snapshots" / COMMIT
    assert started["options"].served_model_name == "acme/tiny"
    started.clear()
    assert cli.main(["serve", "acme/tiny", "--revision", "v2"]) == 2
    assert "at revision 'v2'" in capsys.readouterr().err and not started


def test_serve_help_shows_the_defaults_serve_applies(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "recomputed unless --stop-preempted-request)" in text
    assert "[bool; default: False (True with --engine-type COMPLETION)]" in text
    assert "`deepinfer serve` runs N engine processes behind one server" in text       # --data-parallel-size
    for flag in ("--enable-log-requests", "--tokenizer MODEL", "--revision REV", "--trust-remote-code",
                 "--tensor-parallel-size N", "--max-cache-usage-for-prefill X"):
        assert flag in text
