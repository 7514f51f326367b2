"""The `deepinfer` CLI: version, flags generated from EngineArgs, generate, exit statuses."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from deepinfer.engine import CompletionOutput, EngineArgs, EngineType, SamplingParams, StructuredOutput
from deepinfer.engine.cli import DISTRIBUTIONS, build_parser, finish_text, main, make_sampling_params
from deepinfer.engine.config.dataclass_flags import (
    add_dataclass_flags,
    attribute_docs,
    dataclass_kwargs,
    flag_name,
    parse_int_tuple,
)
from deepinfer.engine.config.env import unknown_env_vars


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_version_names_every_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    def installed(name: str) -> str:            # spec and eplb are not dependencies of the engine
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    assert len(DISTRIBUTIONS) == 7
    expected = (f"deepinfer-engine {version('deepinfer-engine')} (kernels {version('deepinfer-kernels')}, "
                f"model {version('deepinfer-model')}, cache {version('deepinfer-cache')}, "
                f"sched {version('deepinfer-sched')}, spec {installed('deepinfer-spec')}, "
                f"eplb {installed('deepinfer-eplb')})\n")
    assert _run(capsys, "--version") == (0, expected, "")


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_every_engine_field_has_a_flag_with_the_docstring_help(command: str) -> None:
    docs = attribute_docs(EngineArgs)
    actions = {a.dest: a for a in _subparser(command)._actions}
    for field in dataclasses.fields(EngineArgs):
        action = actions[field.name]
        assert flag_name(field.name) in action.option_strings
        assert docs[field.name] and action.help.startswith(docs[field.name].replace("%", "%%"))
        assert "default: " in action.help and action.default is argparse.SUPPRESS
    assert actions["kv_quant"].option_strings == ["--kv-quant", "--no-kv-quant"]


@pytest.mark.parametrize("argv", [["generate", "x"], ["bench"]])
def test_no_engine_flags_give_engine_args_defaults(argv: list[str]) -> None:
    ns = build_parser().parse_args(argv)
    assert dataclass_kwargs(ns, EngineArgs) == {}
    assert EngineArgs(**dataclass_kwargs(ns, EngineArgs)) == EngineArgs()


def test_engine_flags_of_every_type_parse_into_engine_args() -> None:
    ns = build_parser().parse_args([
        "bench", "--model", "some/dir", "--device", "cuda:1", "--dtype", "bfloat16", "--seed", "3",
        "--max-model-len", "128", "--block-size", "16", "--num-kv-blocks", "40", "--kv-cache-memory-mb", "64.5",
        "--gpu-memory-utilization", "0.5", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
        "--max-num-prompts", "4", "--prefill-max-sum-seqlen-k", "512", "--chunk-checkpoints", "8,16",
        "--no-stop-preempted-request", "--engine-type", "prompt", "--kv-quant", "--expert-dtype", "fp8",
        "--enforce-eager",
    ])
    assert EngineArgs(**dataclass_kwargs(ns, EngineArgs)) == EngineArgs(
        model="some/dir", device="cuda:1", dtype="bfloat16", seed=3, max_model_len=128, block_size=16,
        num_kv_blocks=40, kv_cache_memory_mb=64.5, gpu_memory_utilization=0.5, max_num_seqs=8,
        max_num_batched_tokens=256, max_num_prompts=4, prefill_max_sum_seqlen_k=512, chunk_checkpoints=(8, 16),
        stop_preempted_request=False, engine_type=EngineType.PROMPT, kv_quant=True, expert_dtype="fp8",
        enforce_eager=True,
    )
    assert parse_int_tuple("") == () and parse_int_tuple("4") == (4,)


def test_generate_passes_only_the_engine_flags_given(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer.engine import llm

    seen: list[dict] = []

    def refuse(**kwargs: object) -> None:
        seen.append(kwargs)
        raise ValueError("no engine in this test")

    monkeypatch.setattr(llm, "LLM", refuse)
    assert _run(capsys, "generate", "x", "--max-num-seqs", "4", "--no-enforce-eager") == (
        1, "", "deepinfer: error: no engine in this test\n")
    assert seen == [{"max_num_seqs": 4, "enforce_eager": False}]      # LLM's own defaults apply to the rest


@dataclasses.dataclass
class _Example:
    """An example.

    Attributes:
        size: how many, a first line that
            goes on here
              and deeper still.
        ratio (float): parts of one.
        on: a switch.

    Raises:
        ValueError: never.
    """

    size: int = 3
    ratio: float | None = None
    on: bool = False


def test_attribute_docs_joins_continuation_lines_and_stops_at_the_next_section() -> None:
    assert attribute_docs(_Example) == {
        "size": "how many, a first line that goes on here and deeper still.",
        "ratio": "parts of one.",
        "on": "a switch.",
    }


def test_dataclass_flags_need_a_description_per_field() -> None:
    @dataclasses.dataclass
    class Undocumented:
        """Undocumented.

        Attributes:
            size: documented.
        """

        size: int = 1
        other: int = 2

    with pytest.raises(TypeError, match="Undocumented.other has no entry in the docstring's Attributes"):
        add_dataclass_flags(argparse.ArgumentParser(), Undocumented)
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, _Example, allowed=lambda name: f"<{name}>")
    assert dataclass_kwargs(parser.parse_args(["--ratio", "0.5", "--on"]), _Example) == {"ratio": 0.5, "on": True}
    assert {a.dest: a.help for a in parser._actions}["size"] == (
        "how many, a first line that goes on here and deeper still. [<size>; default: 3]")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "x", "--gpu-memory-utilization", "1.5"],
         "argument --gpu-memory-utilization: gpu_memory_utilization=1.5 must be in (0, 1)"),
        (["generate", "x", "--chunk-checkpoints", "8,4"], "argument --chunk-checkpoints: chunk_checkpoints[1]=4 "
         "must be > chunk_checkpoints[0]=8: positions are strictly increasing"),
        (["generate", "x", "--chunk-checkpoints", "0"],
         "argument --chunk-checkpoints: chunk_checkpoints[0]=0 must be an integer in [1, 2147483647]"),
        (["generate", "x", "--chunk-checkpoints", "a"],
         "argument --chunk-checkpoints: 'a' must be comma-separated integers, e.g. 256,512"),
        (["bench", "--engine-type", "foo"], "argument --engine-type: 'foo' must be one of NORMAL, PROMPT, COMPLETION"),
        (["bench", "--max-num-seqs", "0"],
         "argument --max-num-seqs: max_num_seqs=0 must be an integer in [1, 1048576]"),
        (["bench", "--kv-cache-memory-mb", "1e9"], "argument --kv-cache-memory-mb: kv_cache_memory_mb=1000000000.0 "
         "must be > 0 and <= 16777216 (MiB, 16 TiB)"),
        (["bench", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["generate", "x", "--top-p", "1.5"], "argument --top-p: top_p=1.5 must be in (0, 1]"),
        (["generate", "x", "--min-p", "2"], "argument --min-p: min_p=2.0 must be in [0, 1]"),
        (["generate", "x", "--logprobs", "21"], "argument --logprobs: logprobs=21 must be None or in [0, 20]"),
        (["generate", "x", "--max-tokens", "0"], "argument --max-tokens: max_tokens=0 must be >= 1"),
        (["generate", "x", "--sample-seed", "-1"], "argument --sample-seed: seed=-1 must be None or in [0, 2**64 - 1]"),
        (["generate", "x", "--stop", ""], "argument --stop: stop[0]='' must be a non-empty str"),
        (["generate", "x", "--choice", "a", "--regex", "b"], "argument --regex: not allowed with argument --choice"),
        (["generate", "x", "--json-schema", "{bad"], "argument --json-schema: structured.json is not valid JSON text"),
        (["generate", "x", "--json-schema", "@/nonexistent/schema.json"],
         "argument --json-schema: cannot read '/nonexistent/schema.json': No such file or directory"),
        (["generate", "x", "--choice", ""], "argument --choice: structured.choice[0]='' must be a non-empty str"),
        (["generate"], "the following arguments are required: prompts"),
        (["serve", "--pd-prefill-url", "http://h:1"], "argument --pd-prefill-url: only with --pd-role decode"),
        (["serve", "--pd-role", "decode"], "argument --pd-prefill-url: needed with --pd-role decode, and only there"),
        (["serve", "--pd-role", "prefill", "--engine-type", "COMPLETION"],
         "argument --engine-type: COMPLETION does not go with --pd-role prefill (PROMPT)"),
        (["serve", "--pd-role", "prefill", "--data-parallel-size", "2"],
         "argument --data-parallel-size: a prefill/decode pair runs one rank a side (not supported yet)"),
        (["serve", "--pd-role", "both"], "argument --pd-role: invalid choice: 'both'"),
        (["serve", "--pd-prefill-api-key", "k"], "argument --pd-prefill-api-key: only with --pd-role decode (a "
         "prefill server checks its own --api-key)"),
        (["serve", "--pd-role", "prefill", "--pd-prefill-api-key", "k"],
         "argument --pd-prefill-api-key: only with --pd-role decode"),
        (["serve", "--pd-role", "decode", "--pd-prefill-url", "http://h:1", "--pd-prefill-api-key", ""],
         "argument --pd-prefill-api-key: the prefill server's API key must be a non-empty str of printable ASCII"),
        (["serve", "--pd-role", "decode", "--pd-prefill-url", "http://h:1", "--api-key", "k\u00e9y"],
         "argument --api-key: the prefill server's API key must be a non-empty str of printable ASCII"),
        (["serve", "--shutdown-timeout-s", "0"], "shutdown_timeout_s=0.0 must be a number of seconds > 0 (and finite)"),
        (["serve", "--shutdown-timeout-s", "-1"], "shutdown_timeout_s=-1.0 must be a number of seconds > 0"),
        (["serve", "--shutdown-timeout-s", "nan"], "shutdown_timeout_s=nan must be a number of seconds > 0"),
        (["serve", "--shutdown-timeout-s", "inf"], "shutdown_timeout_s=inf must be a number of seconds > 0"),
        (["serve", "--shutdown-timeout-s", "soon"], "argument --shutdown-timeout-s: invalid float value: 'soon'"),
        ([], "the following arguments are required: command"),
    ],
)
def test_usage_errors_exit_2_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str],
                                             message: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith("usage: deepinfer") and message in err.splitlines()[-1]
    assert "Traceback" not in err


def test_sampling_flags_make_sampling_params(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    parser = _subparser("generate")

    def params(*flags: str) -> SamplingParams:
        return make_sampling_params(parser.parse_args(["x", *flags]), parser)

    assert params() == SamplingParams(max_tokens=64, temperature=0.0)
    assert params("--stop", "a", "--stop", "\n", "--min-p", "0.1", "--logprobs", "3", "--top-k", "5", "--top-p",
                  "0.9", "--temperature", "0.7", "--sample-seed", "7", "--max-tokens", "9",
                  "--json-schema", f"@{tmp_path / 'schema.json'}") == SamplingParams(
        max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=7, stop=("a", "\n"), logprobs=3,
        structured=StructuredOutput(json=schema))
    assert params("--json-schema", '{"type": "integer"}').structured == StructuredOutput(json={"type": "integer"})
    assert params("--regex", "[ab]+").structured == StructuredOutput(regex="[ab]+")
    assert params("--choice", "yes", "--choice", "no").structured == StructuredOutput(choice=("yes", "no"))


def test_finish_text_gives_the_reason() -> None:
    def text(**kw: object) -> str:
        return finish_text(CompletionOutput(index=0, text="", token_ids=[], **kw))

    assert text(finish_reason="length") == "finish_reason=length"
    assert text(finish_reason="ignored", ignored_reason="prompt longer than max_model_len") == (
        "finish_reason=ignored: prompt longer than max_model_len")
    assert text(finish_reason="error", error_reason="grammar dead end") == "finish_reason=error: grammar dead end"
    assert text(finish_reason="stop", stop_reason="\n") == r"finish_reason=stop, stop_reason='\n'"


def test_load_errors_exit_1_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "missing"
    assert _run(capsys, "generate", "x", "--model", str(missing)) == (
        1, "", f"deepinfer: error: model={str(missing)!r} is not a folder (expected config.json + model.safetensors)\n")
    (tmp_path / "config.json").write_text("{")
    code, out, err = _run(capsys, "bench", "--model", str(tmp_path))
    assert (code, out) == (1, "")
    assert re.fullmatch(r"deepinfer: error: \S+config.json: not valid JSON: [^\n]+\n", err)
    monkeypatch.setenv("DEEPINFER_MAX_BACKTRACKING_TOKENS", "-2")
    assert _run(capsys, "generate", "x") == (1, "", "deepinfer: error: DEEPINFER_MAX_BACKTRACKING_TOKENS=-2 must be an "
                                                    "int >= 0\n")


def test_generate_prints_outputs_logprobs_and_finish_reasons(capsys: pytest.CaptureFixture[str],
                                                            caplog: pytest.LogCaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for name in unknown_env_vars():              # the caller's own stray variables would be warned about too
        monkeypatch.delenv(name)
    monkeypatch.setenv("DEEPINFER_DISABLE_SYNC_GAURD", "1")
    long_prompt = "x " * 40
    with caplog.at_level(logging.WARNING, logger="deepinfer.engine.config.env"):
        code, out, err = _run(capsys, "generate", "def fibonacci(", long_prompt, "--max-tokens", "4", "--stop", ":",
                              "--logprobs", "2", "--min-p", "0.05", "--max-model-len", "16")
    assert code == 0
    assert [r.getMessage() for r in caplog.records] == [
        "DEEPINFER_DISABLE_SYNC_GAURD is not a DeepInfer environment variable; it is ignored "
        "(did you mean DEEPINFER_DISABLE_SYNC_GUARD?)"]
    lines = out.splitlines()
    assert lines[0] == "def fibonacci(l)" and lines[3] == long_prompt
    for line in lines[1:3]:                   # the two output tokens, each with its two alternatives
        match = re.fullmatch(r"  logprob\[\d\] (\S+) (-?\d+\.\d{4}) \| (.*)", line)
        assert match and len(match.group(3).split(", ")) in (2, 3) and f"{match[1]} {match[2]}" in match[3]
    err_lines = [line for line in err.splitlines() if line and not line.startswith("Loading weights")]  # the bar
    assert re.fullmatch(r"loaded \S+embedded in \d+\.\d\d s, \d+\.\d MiB of weights", err_lines[0])
    assert err_lines[1:] == ["[2 tokens, finish_reason=stop, stop_reason=':']",
                             "[0 tokens, finish_reason=ignored: prompt longer than max_model_len]"]


def test_generate_follows_a_choice(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "generate", "answer: ", "--choice", "yes", "--choice", "no", "--max-tokens", "8")
    assert (code, out) == (0, "answer: yes\n")
    assert err.splitlines()[-1].endswith("finish_reason=stop]")


def test_the_cli_imports_no_server_dependency_until_serve_runs() -> None:
    """`deepinfer bench` / `generate` run where FastAPI, uvicorn and prometheus_client are missing (the
    lent GPU machine has none): importing the CLI and the generated-docs module loads none of them."""
    probe = ("import sys, deepinfer.engine.cli, deepinfer.engine.gen_docs\n"
             "print(sorted(m for m in ('fastapi', 'uvicorn', 'prometheus_client') if m in sys.modules))")
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "[]", ran.stdout
