"""deepinfer.engine — the DeepInfer engine and its user API.

    from deepinfer.engine import LLM, SamplingParams
    llm = LLM(model="path/to/model")            # None = the embedded default model
    outs = llm.generate(["def fibonacci("], SamplingParams(temperature=0, max_tokens=32))

`AsyncLLM` drives an LLMEngine from its own thread for asyncio callers (`async for out in
llm.generate(...)`), `AsyncLLMProcess` one in a child process of its own (the same interface);
`deepinfer serve` (`deepinfer.engine.serve`) puts an OpenAI-compatible HTTP server in front of the
latter (of the former with `--engine-in-thread`), and `LLM.chat` renders conversations with the model's chat template.
`LLMEngine` exposes the step loop (add_request / abort_request / step / has_unfinished_requests);
`EngineArgs` holds every engine knob, validated; `deepinfer generate`, `bench` and `serve` are the CLI.
Names are imported on first use, so a submodule (e.g. `deepinfer.engine.core.cuda_graphs`) can be used
without loading the whole engine. `SamplingParams(structured=StructuredOutput(json=schema))`
constrains an output (JSON schema, regex, EBNF grammar or choice) through xgrammar (the `structured`
extra).
"""

from __future__ import annotations

import importlib
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

__version__ = _version("deepinfer-engine")

_EXPORTS = {
    "LLM": ".llm",
    "AsyncLLM": ".frontends.async_llm",
    "AsyncLLMProcess": ".frontends.async_process",
    "CompletionOutput": ".core.outputs",
    "EngineArgs": ".config.engine_args",
    "EngineType": "deepinfer.sched",
    "InvalidEngineArgs": ".config.engine_args",
    "InvalidSamplingParams": ".sampling.sampling_params",
    "LLMEngine": ".llm_engine",
    "Logprob": ".core.outputs",
    "OutputKind": ".core.outputs",
    "RequestOutput": ".core.outputs",
    "SamplingParams": ".sampling.sampling_params",
    "StructuredOutput": ".sampling.sampling_params",
    "StructuredOutputUnavailable": ".sampling.grammar_backend",
}
__all__ = [
    "LLM",
    "AsyncLLM",
    "AsyncLLMProcess",
    "CompletionOutput",
    "EngineArgs",
    "EngineType",
    "InvalidEngineArgs",
    "InvalidSamplingParams",
    "LLMEngine",
    "Logprob",
    "OutputKind",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
    "StructuredOutputUnavailable",
]

if TYPE_CHECKING:
    from deepinfer.sched import EngineType

    from .config.engine_args import EngineArgs, InvalidEngineArgs
    from .core.outputs import CompletionOutput, Logprob, OutputKind, RequestOutput
    from .frontends.async_llm import AsyncLLM
    from .frontends.async_process import AsyncLLMProcess
    from .llm import LLM
    from .llm_engine import LLMEngine
    from .sampling.grammar_backend import StructuredOutputUnavailable
    from .sampling.sampling_params import InvalidSamplingParams, SamplingParams, StructuredOutput


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepinfer.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
