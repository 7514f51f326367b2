"""`deepinfer serve`'s own flags (beside the engine flags made from `EngineArgs`), as data: the one
source of its `--help` (`add_serve_flags`) and of their table in docs/engine_args.md (`gen_docs`).

Some exist for vLLM users (`vllm serve` habits): a positional MODEL, `--tokenizer`, `--revision`,
`--trust-remote-code` and `--tensor-parallel-size`; `cli` says where they do not apply.
`ENGINE_DEFAULTS_BY_COMMAND` holds the engine defaults a command applies itself (LLM for generate,
`deepinfer serve`), shown in their help and in the docs in place of `EngineArgs`' own.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..frontends.async_front import DEFAULT_MAX_NUM_WAITING

SHUTDOWN_TIMEOUT_S = 30.0    # the longest a SIGTERM drain waits for the requests in flight (`ServeOptions`' default)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
MODEL_HELP = "model folder or cached Hugging Face repo id, as --model (give one of the two)"
_RECOMPUTE = "False (True with --engine-type COMPLETION)"
# Engine defaults a command applies itself; each value is what its help and the docs show.
ENGINE_DEFAULTS_BY_COMMAND: dict[str, dict[str, str]] = {
    "generate": {"stop_preempted_request": _RECOMPUTE},
    "serve": {"stop_preempted_request": _RECOMPUTE},
}


@dataclass(frozen=True, slots=True)
class ServeFlag:
    """One flag of `deepinfer serve`.

    Attributes:
        flag: the option string ("--host").
        help: what it does (the default is appended in help and docs).
        default: its value when left out.
        kind: argparse's `type` (str, int); None = a switch (store_true, default False).
        metavar: the value's name in help; None = argparse's.
        choices: the only values it takes; None = any of `kind`.
    """

    flag: str
    help: str
    default: object = None
    kind: type | None = str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def shown_default(self) -> str:
        return "unset" if self.default is None else str(self.default)

    def add_to(self, group: argparse._ArgumentGroup) -> None:
        text = f"{self.help} [default: {self.shown_default}]".replace("%", "%%")
        if self.kind is None:
            group.add_argument(self.flag, dest=self.dest, action="store_true", help=text)
            return
        group.add_argument(self.flag, dest=self.dest, type=self.kind, default=self.default, metavar=self.metavar,
                           choices=self.choices, help=text)


SERVE_FLAGS: tuple[ServeFlag, ...] = (
    ServeFlag("--host", "address to bind; 0.0.0.0 = every interface", "127.0.0.1"),
    ServeFlag("--port", "TCP port", 8000, int),
    ServeFlag("--served-model-name", "the model name clients send and /v1/models lists; unset = MODEL (--model) "
              "as given, or deepinfer-embedded", metavar="NAME"),
    ServeFlag("--api-key", "require `Authorization: Bearer KEY` on /v1/* (a prefill server's /v1/pd/* "
              "included), /tokenize and /detokenize; unset = no check", metavar="KEY"),
    ServeFlag("--chat-template", "deepseek_v4, plain, or a jinja file; unset = the model folder's",
              metavar="NAME|FILE"),
    ServeFlag("--max-num-waiting", "requests waiting to run before new ones get 503", DEFAULT_MAX_NUM_WAITING, int,
              metavar="N"),
    ServeFlag("--log-level", "server log level", "info", choices=LOG_LEVELS),
    ServeFlag("--shutdown-timeout-s", "on SIGTERM, how long the requests in flight may take to finish (> 0); those "
              "still running then (say, a stream its client stopped reading) are cut: their connections closed, the "
              "engine aborts them, and the server exits 0 saying how many", SHUTDOWN_TIMEOUT_S, float,
              metavar="SECONDS"),
    ServeFlag("--enable-log-requests", "log one access line per HTTP request (client, method, path, status) at "
              "--log-level info", False, None),
    ServeFlag("--tool-call-parser", "deepseek_v4 or hermes: finds tool calls in tool_choice=auto output",
              metavar="NAME"),
    ServeFlag("--enable-auto-tool-choice", "accept tool_choice=auto (needs --tool-call-parser)", False, None),
    ServeFlag("--reasoning-parser", "deepseek_v4: the thinking goes to reasoning_content", metavar="NAME"),
    ServeFlag("--engine-in-thread", "step the engine in a thread of the server's process, as before the engine "
              "process (its steps and the per-token HTTP work then share one interpreter lock); off = a process of "
              "its own; not with --data-parallel-size > 1", False, None),
    ServeFlag("--pd-role", "serve one side of a prefill/decode pair: prefill = a PROMPT engine answering "
              "/v1/pd/prefill (in a thread of the server), decode = a COMPLETION engine that has each prompt "
              "prefilled by --pd-prefill-url and streams the tokens (clients talk to it); unset = one NORMAL "
              "engine", choices=("prefill", "decode"), metavar="ROLE"),
    ServeFlag("--pd-prefill-url", "with --pd-role decode: the prefill server, http://HOST:PORT (it must serve the "
              "same model; checked at start)", metavar="URL"),
    ServeFlag("--pd-prefill-api-key", "with --pd-role decode: the prefill server's --api-key, sent as "
              "`Authorization: Bearer KEY` on /v1/pd/*; a key it refuses stops the start (401 invalid_api_key); "
              "unset = this server's --api-key", metavar="KEY"),
    ServeFlag("--tokenizer", "vLLM's flag: DeepInfer reads the tokenizer from the model folder (tokenizer.json), "
              "so it may only name MODEL itself; another tokenizer is refused", metavar="MODEL"),
    ServeFlag("--revision", "the revision (branch, tag or commit) of a Hugging Face repo id MODEL, read from the "
              "local cache; refused for a folder; unset = main", metavar="REV"),
    ServeFlag("--trust-remote-code", "vLLM's flag, accepted with a note: DeepInfer never runs code from a model "
              "folder (config.json, tokenizer.json and safetensors are read as data)", False, None),
    ServeFlag("--tensor-parallel-size", "vLLM's flag: only 1; DeepInfer spreads a model over GPUs with "
              "data-parallel attention and expert-parallel MoE (--data-parallel-size N --expert-parallel)", 1, int,
              metavar="N"),
)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """MODEL (positional, optional) and every `SERVE_FLAGS` flag, in a "server" group."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=MODEL_HELP)
    group = parser.add_argument_group("server")
    for flag in SERVE_FLAGS:
        flag.add_to(group)
