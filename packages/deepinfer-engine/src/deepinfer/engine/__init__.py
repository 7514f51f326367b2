"""deepinfer.engine — the DeepInfer engine and its user API.

    from deepinfer.engine import LLM, SamplingParams
    llm = LLM(model="path/to/model")            # None = the embedded default model
    outs = llm.generate(["def fibonacci("], SamplingParams(temperature=0, max_tokens=32))

`LLMEngine` exposes the step loop (add_request / abort_request / step / has_unfinished_requests);
`EngineArgs` holds every engine knob, validated; `deepinfer generate` and `deepinfer bench` are the CLI.
"""

from importlib.metadata import version as _version

from deepinfer.sched import EngineType

from .engine_args import EngineArgs, InvalidEngineArgs
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import InvalidSamplingParams, SamplingParams

__version__ = _version("deepinfer-engine")
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineType",
    "InvalidEngineArgs",
    "InvalidSamplingParams",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
