"""The `deepinfer` command: `deepinfer generate`, `deepinfer bench`, `deepinfer serve` and `deepinfer --version`.

The engine flags of every subcommand are made from `EngineArgs` (names, help and defaults: see
`dataclass_flags`); a flag left out is not passed, so `LLM` (generate) and `LLMEngine` (bench) apply
their own defaults. Exit status: 0 on success; 2 on a usage error (the message names the flag); 1
when the engine cannot be built or loaded, with one line `deepinfer: error: ...` and no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepinfer.sched import EngineType

from .bench import BenchWorkload, InvalidBenchArgs, run_bench
from .config.dataclass_flags import add_dataclass_flags, dataclass_kwargs, flag_name
from .config.engine_args import AUTO, DTYPES, EXPERT_DTYPES, LOAD_FORMATS, EngineArgs, InvalidEngineArgs, allowed_values
from .config.model_source import ModelNotCached, resolve_model_source
from .sampling.sampling_params import InvalidSamplingParams, SamplingParams, StructuredOutput
from .serve.flags import ENGINE_DEFAULTS_BY_COMMAND, add_serve_flags

if TYPE_CHECKING:
    from .core.outputs import CompletionOutput
    from .llm_engine import LLMEngine
    from .serve import ServeEnd
    from .text.tokenizer import Tokenizer

__all__ = ["DISTRIBUTIONS", "build_parser", "finish_text", "main", "make_sampling_params", "run_bench", "version_text"]

DISTRIBUTIONS = ("deepinfer-engine", "deepinfer-kernels", "deepinfer-model", "deepinfer-cache", "deepinfer-sched",
                 "deepinfer-spec", "deepinfer-eplb")
# What building or loading an engine raises for a bad folder, config, weight file, environment
# variable or device: InvalidEngineArgs, ConfigError, WeightError, InvalidEnvVar and
# TokenizerLoadError are ValueErrors; a CUDA failure is a RuntimeError.
LOAD_ERRORS = (ValueError, OSError, RuntimeError)
# generate's sampling flags -> SamplingParams fields; defaults are SamplingParams' own except these.
SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
                  "top_k": "--top-k", "min_p": "--min-p", "seed": "--sample-seed", "stop": "--stop",
                  "logprobs": "--logprobs"}
GENERATE_DEFAULTS = {"max_tokens": 64, "temperature": 0.0}
STRUCTURED_FLAGS = {"json": "--json-schema", "regex": "--regex", "choice": "--choice"}


class _CommandError(Exception):
    """The command failed (not its usage: the engine did not load, a file could not be written, ...);
    main() prints the message on one line and exits 1."""


def version_text() -> str:
    """'deepinfer-engine X (kernels Y, model Z, ...)': the installed version of every distribution."""
    versions = []
    for name in DISTRIBUTIONS:
        try:
            versions.append(version(name))
        except PackageNotFoundError:
            versions.append("not installed")
    others = ", ".join(f"{name.removeprefix('deepinfer-')} {v}" for name, v in zip(DISTRIBUTIONS[1:], versions[1:]))
    return f"{DISTRIBUTIONS[0]} {versions[0]} ({others})"


def build_parser() -> argparse.ArgumentParser:
    """The `deepinfer` argument parser (subcommands generate and bench)."""
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer: DeepSeek-V4 inference engine",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # --version unwrapped
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts",
                         description="Generate text for each prompt with an LLM; prints prompt + output on "
                                     "stdout, token count and finish reason on stderr.")
    gen.add_argument("prompts", nargs="+")
    _sampling_flags(gen)
    _engine_flags(gen, "generate", "engine arguments (EngineArgs; a flag left out is not passed, so LLM's own "
                                   "default applies where it has one, see its docstring)")
    gen.set_defaults(run=_generate, parser=gen)
    bench = sub.add_parser("bench", help="throughput, TTFT, TPOT and ITL on a synthetic workload",
                           description="Random-token prompts through an LLMEngine; prints the metrics as JSON.")
    _bench_flags(bench)
    _engine_flags(bench, "bench", "engine arguments (EngineArgs)")
    bench.set_defaults(run=_bench, parser=bench)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                           description="Serve the model over HTTP: /v1/completions, /v1/chat/completions, "
                                       "/v1/models, /tokenize, /detokenize, /health, /version, /metrics, /docs. "
                                       "SIGTERM drains the requests in flight (for up to "
                                       "--shutdown-timeout-s), then exits. The engine steps in a process of its "
                                       "own (the HTTP work runs beside it on another core; --engine-in-thread "
                                       "keeps it in a thread of the server's process); --data-parallel-size N "
                                       "runs N engine processes (with --expert-parallel sharding the experts over "
                                       "them).")
    add_serve_flags(serve)
    _engine_flags(serve, "serve", "engine arguments (EngineArgs; a flag left out is not passed; preempted requests "
                                  "are recomputed unless --stop-preempted-request)")
    serve.set_defaults(run=_serve, parser=serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
        return ns.run(ns, ns.parser)
    except SystemExit as exit_:           # argparse's usage errors (2), --help and --version (0)
        return exit_.code if isinstance(exit_.code, int) else 1
    except _CommandError as error:
        print(f"deepinfer: error: {error}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------------------------------- flags

def _engine_flags(parser: argparse.ArgumentParser, command: str, title: str) -> None:
    add_dataclass_flags(parser.add_argument_group(title), EngineArgs, allowed=allowed_values,
                        choices={"dtype": (AUTO, *DTYPES), "expert_dtype": EXPERT_DTYPES,
                                 "load_format": LOAD_FORMATS},
                        shown_defaults=ENGINE_DEFAULTS_BY_COMMAND.get(command))


def _sampling_flags(parser: argparse.ArgumentParser) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)} | GENERATE_DEFAULTS
    group = parser.add_argument_group("sampling (SamplingParams)")
    specs: dict[str, tuple[Any, str]] = {
        "max_tokens": (int, "output tokens per prompt, >= 1"),
        "temperature": (float, ">= 0; 0 = greedy"),
        "top_p": (float, "keep the most likely tokens whose probability sums to top_p, in (0, 1]"),
        "top_k": (int, "keep the top_k most likely tokens; -1 or 0 = off"),
        "min_p": (float, "drop tokens less likely than min_p × the top token's probability, in [0, 1]"),
        "seed": (int, "the request's own generator seed, in [0, 2**64 - 1]; unset = the engine's (--seed)"),
        "logprobs": (int, "print the logprob of each output token and of its N most likely alternatives, "
                          "N in [0, 20]"),
    }
    for name, (kind, text) in specs.items():
        group.add_argument(SAMPLING_FLAGS[name], dest=name, type=kind, default=argparse.SUPPRESS,
                           metavar="N" if kind is int else "X", help=f"{text} [default: {defaults[name]}]")
    group.add_argument("--stop", dest="stop", action="append", default=argparse.SUPPRESS, metavar="TEXT",
                       help="stop string (repeatable): the output ends at the first one, which is cut from it")
    structured = parser.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    structured.add_argument("--json-schema", dest="json", metavar="SCHEMA", default=None,
                            help="the output is JSON valid against this schema: JSON text, or @FILE to read it")
    structured.add_argument("--regex", dest="regex", metavar="REGEX", default=None,
                            help="the whole output matches this regular expression")
    structured.add_argument("--choice", dest="choice", action="append", metavar="TEXT", default=None,
                            help="the output is exactly one of the given strings (repeat the flag)")


def _bench_flags(parser: argparse.ArgumentParser) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(BenchWorkload)}
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=int, default=16, metavar="N", help="timed requests [default: 16]")
    group.add_argument("--input-len", type=int, default=64, metavar="N", help="prompt tokens per request "
                       "(random ids) [default: 64]")
    group.add_argument("--output-len", type=int, default=32, metavar="N", help="output tokens per request "
                       "(EOS ignored) [default: 32]")
    group.add_argument("--num-warmup", type=int, default=defaults["num_warmup"], metavar="N",
                       help=f"requests run and discarded before timing [default: {defaults['num_warmup']}]")
    group.add_argument("--request-rate", type=float, default=defaults["request_rate"], metavar="R",
                       help="mean arrivals per second (Poisson, seeded by --seed); inf = all at once "
                            f"[default: {defaults['request_rate']}]")
    group.add_argument("--max-concurrency", type=int, default=defaults["max_concurrency"], metavar="C",
                       help="most requests in the engine at once [default: no limit]")
    group.add_argument("--output-json", metavar="FILE", default=None, help="also write the result to FILE")


# ---------------------------------------------------------------------------------------- generate

def _generate(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    params = make_sampling_params(ns, parser)
    engine_kwargs, args = _engine_args(ns, parser)
    from .llm import LLM
    from .sampling.grammar_backend import StructuredOutputUnavailable

    llm = _build(lambda: LLM(**engine_kwargs), args)
    try:
        outputs = llm.generate(ns.prompts, params, use_tqdm=False)
    except (ValueError, StructuredOutputUnavailable) as error:   # e.g. text prompts but no tokenizer.json
        raise _CommandError(_one_line(error)) from None
    for out in outputs:
        completion = out.outputs[0]
        prompt = out.prompt if out.prompt is not None else ""
        print(f"{prompt}{completion.text}")
        if completion.logprobs is not None:
            _print_logprobs(completion, llm.engine.tokenizer)
        print(f"[{len(completion.token_ids)} tokens, {finish_text(completion)}]", file=sys.stderr)
    return 0


def make_sampling_params(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> SamplingParams:
    """generate's SamplingParams from its parsed flags; a bad value is a usage error naming its flag
    (parser.error, exit status 2)."""
    given = {name: getattr(ns, name) for name in SAMPLING_FLAGS if hasattr(ns, name)}
    values = GENERATE_DEFAULTS | given
    for name, value in values.items():            # one at a time, so that an error names its flag
        try:
            SamplingParams(**{name: value})
        except InvalidSamplingParams as error:
            parser.error(f"argument {SAMPLING_FLAGS[name]}: {error}")
    structured = None
    kind = next((k for k in STRUCTURED_FLAGS if getattr(ns, k) is not None), None)
    if kind is not None:
        value = getattr(ns, kind)
        if kind == "json" and value.startswith("@"):
            try:
                value = Path(value[1:]).read_text()
            except OSError as error:
                parser.error(f"argument --json-schema: cannot read {value[1:]!r}: {error.strerror or error}")
        try:
            structured = StructuredOutput(**{kind: value})
        except InvalidSamplingParams as error:
            parser.error(f"argument {STRUCTURED_FLAGS[kind]}: {error}")
    try:
        return SamplingParams(**values, structured=structured)
    except InvalidSamplingParams as error:
        parser.error(str(error))


def finish_text(completion: CompletionOutput) -> str:
    """'finish_reason=R', with the reason of an ignored or failed request or the stop string / id."""
    text = f"finish_reason={completion.finish_reason}"
    if completion.ignored_reason is not None:
        return f"{text}: {completion.ignored_reason}"
    if completion.error_reason is not None:
        return f"{text}: {completion.error_reason}"
    if completion.stop_reason is not None:
        return f"{text}, stop_reason={completion.stop_reason!r}"
    return text


def _print_logprobs(completion: CompletionOutput, tokenizer: Tokenizer | None) -> None:
    def show(token_id: int) -> str:
        if tokenizer is None:
            return str(token_id)
        return repr(tokenizer.decode([token_id], skip_special_tokens=False))

    for position, (token_id, logprobs) in enumerate(zip(completion.token_ids, completion.logprobs or [])):
        ranked = sorted(logprobs.items(), key=lambda item: (-item[1], item[0]))
        alternatives = ", ".join(f"{show(t)} {lp:.4f}" for t, lp in ranked)
        print(f"  logprob[{position}] {show(token_id)} {logprobs[token_id]:.4f} | {alternatives}")


# ---------------------------------------------------------------------------------------- bench

def _bench(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    engine_kwargs, args = _engine_args(ns, parser)
    try:
        workload = BenchWorkload(ns.num_prompts, ns.input_len, ns.output_len, args.seed, ns.num_warmup,
                                 ns.request_rate, ns.max_concurrency)
    except InvalidBenchArgs as error:
        parser.error(f"argument {'/'.join(map(flag_name, error.fields))}: {error}")
    if ns.output_json is not None and not Path(ns.output_json).parent.is_dir():
        parser.error(f"argument --output-json: folder {str(Path(ns.output_json).parent)!r} does not exist")
    from .llm_engine import LLMEngine

    engine = _build(lambda: LLMEngine(args), args)
    try:
        workload.check_fits(engine.max_model_len)
    except InvalidBenchArgs as error:
        parser.error(f"argument {'/'.join(map(flag_name, error.fields))}: {error} (see --max-model-len)")
    result = run_bench(engine, workload.num_prompts, workload.input_len, workload.output_len, workload.seed,
                       num_warmup=workload.num_warmup, request_rate=workload.request_rate,
                       max_concurrency=workload.max_concurrency, progress=True)
    result.update(device=engine.args.device, dtype=engine.args.dtype, model=str(engine.model_dir))
    text = json.dumps(result, indent=2, allow_nan=False)
    print(text)
    if ns.output_json is not None:
        try:
            Path(ns.output_json).write_text(text + "\n")
        except OSError as error:
            raise _CommandError(f"cannot write --output-json {ns.output_json!r}: {error.strerror or error}") from None
    return 0


# ---------------------------------------------------------------------------------------- serve

def _serve(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    engine_kwargs = dataclass_kwargs(ns, EngineArgs)
    model_name = _vllm_flags(ns, parser, engine_kwargs)
    _pd_flags(ns, parser, engine_kwargs)
    if engine_kwargs.get("engine_type", EngineType.NORMAL) is not EngineType.COMPLETION:
        engine_kwargs.setdefault("stop_preempted_request", False)     # as LLM: every request gets its output
    _, args = _engine_args(ns, parser, allow_data_parallel=True, kwargs=engine_kwargs)
    from .serve import ServeOptions, run_server, serve_client

    name = ns.served_model_name or model_name or "deepinfer-embedded"
    try:
        options = ServeOptions(host=ns.host, port=ns.port, served_model_name=name, api_key=ns.api_key,
                               chat_template=ns.chat_template, max_num_waiting=ns.max_num_waiting,
                               log_level=ns.log_level, tool_call_parser=ns.tool_call_parser,
                               enable_auto_tool_choice=ns.enable_auto_tool_choice,
                               reasoning_parser=ns.reasoning_parser, enable_log_requests=ns.enable_log_requests,
                               shutdown_timeout_s=ns.shutdown_timeout_s)
    except ValueError as error:
        parser.error(str(error))
    if ns.pd_role is not None:
        end = _serve_pd(ns.pd_role, ns.pd_prefill_url, args, options, ns.engine_in_thread,
                        options.api_key if ns.pd_prefill_api_key is None else ns.pd_prefill_api_key)
    elif args.data_parallel_size > 1:
        if ns.engine_in_thread:
            parser.error("argument --engine-in-thread: not with --data-parallel-size > 1 (each rank is a process)")
        end = serve_client(_start_ranks(args, options.max_num_waiting), options)
    elif not ns.engine_in_thread:
        end = serve_client(_start_engine_process(args, options.max_num_waiting), options)
    else:
        from .llm_engine import LLMEngine

        end = run_server(_build(lambda: LLMEngine(args), args), options)
    if end.failure is not None:
        print(f"deepinfer serve: stopped; the engine had failed: {_one_line(end.failure)}", file=sys.stderr)
    elif end.num_cut:
        print(f"deepinfer serve: stopped after --shutdown-timeout-s {options.shutdown_timeout_s:g}: cut {end.num_cut} "
              "request(s) still running (their connections closed, the engine aborted them), the engine exited",
              file=sys.stderr)
    else:
        print("deepinfer serve: stopped cleanly (every request finished, the engine exited)", file=sys.stderr)
    return 0


def _pd_flags(ns: argparse.Namespace, parser: argparse.ArgumentParser, engine_kwargs: dict[str, Any]) -> None:
    """--pd-role / --pd-prefill-url / --pd-prefill-api-key: the engine type of the role, or usage errors
    naming the flag."""
    if ns.pd_prefill_api_key is not None and ns.pd_role != "decode":
        parser.error("argument --pd-prefill-api-key: only with --pd-role decode (a prefill server checks its own "
                     "--api-key)")
    if ns.pd_role is None:
        if ns.pd_prefill_url is not None:
            parser.error("argument --pd-prefill-url: only with --pd-role decode")
        return
    wanted = EngineType.PROMPT if ns.pd_role == "prefill" else EngineType.COMPLETION
    given = engine_kwargs.get("engine_type", wanted)
    if given is not wanted:
        parser.error(f"argument --engine-type: {given.name} does not go with --pd-role {ns.pd_role} ({wanted.name})")
    if (ns.pd_role == "decode") != (ns.pd_prefill_url is not None):
        parser.error("argument --pd-prefill-url: needed with --pd-role decode, and only there")
    if engine_kwargs.get("data_parallel_size", 1) != 1:
        parser.error("argument --data-parallel-size: a prefill/decode pair runs one rank a side (not supported yet)")
    key_flag = "--api-key" if ns.pd_prefill_api_key is None else "--pd-prefill-api-key"
    key = ns.api_key if ns.pd_prefill_api_key is None else ns.pd_prefill_api_key
    if ns.pd_role == "decode" and key is not None:
        from .disagg.http_client import check_api_key

        try:
            check_api_key(key)
        except ValueError as error:
            parser.error(f"argument {key_flag}: {error}")
    engine_kwargs["engine_type"] = wanted


def _serve_pd(role: str, prefill_url: str | None, args: EngineArgs, options: Any, in_thread: bool,
              prefill_api_key: str | None) -> ServeEnd:
    """Serve one side of a prefill/decode pair (docs/design.md §15); a decode server sends
    `prefill_api_key` to its prefill server. Returns as `serve_client`."""
    from functools import partial

    from .disagg import HttpPrefillClient, PrefillExports
    from .llm_engine import LLMEngine
    from .serve import run_server, serve_client
    from .serve.pd_routes import add_pd_routes

    if role == "prefill":         # the engine in a thread: a handoff goes on the wire from this process
        from .frontends.async_llm import AsyncLLM

        exports = PrefillExports()
        engine = _build(lambda: LLMEngine(args, kv_transfer=exports), args)
        llm = AsyncLLM(engine, max_num_waiting=options.max_num_waiting)
        return serve_client(llm, options, extra_routes=lambda app: add_pd_routes(app, llm, exports))
    assert prefill_url is not None
    factory = partial(HttpPrefillClient, prefill_url, api_key=prefill_api_key)
    try:
        factory()                                 # the URL's form, checked before the engine loads
    except ValueError as error:
        raise _CommandError(f"argument --pd-prefill-url: {error}") from None
    if in_thread:
        return run_server(_build(lambda: LLMEngine(args, kv_transfer=factory()), args), options)
    return serve_client(_start_engine_process(args, options.max_num_waiting, factory), options)


def _vllm_flags(ns: argparse.Namespace, parser: argparse.ArgumentParser, engine_kwargs: dict[str, Any]) -> str | None:
    """Apply serve's vLLM-habit flags to `engine_kwargs` (MODEL, --revision) or refuse them where they
    do not apply (usage errors naming the flag); returns the model as the user named it."""
    if ns.model_tag is not None:
        given = engine_kwargs.get("model")
        if given is not None and given != ns.model_tag:
            parser.error(f"argument MODEL: {ns.model_tag!r} and --model {given!r} name different models; give one")
        engine_kwargs["model"] = ns.model_tag
    model = engine_kwargs.get("model")
    if ns.tensor_parallel_size != 1:
        parser.error(f"argument --tensor-parallel-size: {ns.tensor_parallel_size} is not supported (only 1): "
                     "DeepInfer spreads a model over GPUs with data-parallel attention and expert-parallel MoE, "
                     "--data-parallel-size N --expert-parallel")
    if ns.tokenizer is not None and not _same_model(ns.tokenizer, model):
        parser.error(f"argument --tokenizer: {ns.tokenizer!r} is not MODEL ({model or 'the embedded model'}): "
                     "DeepInfer reads the tokenizer from the model folder (tokenizer.json); another tokenizer is "
                     "not supported yet")
    if ns.revision is not None:
        if model is None or Path(model).is_dir():
            parser.error(f"argument --revision: applies to a Hugging Face repo id in the local cache, not to "
                         f"{'the embedded model' if model is None else f'the folder {model!r}'}")
        try:
            engine_kwargs["model"] = resolve_model_source(model, revision=ns.revision)
        except ModelNotCached as error:
            parser.error(f"argument --revision: {error}")
    if ns.trust_remote_code:
        print("deepinfer: note: --trust-remote-code has no effect: DeepInfer never runs code from a model folder "
              "(config.json, tokenizer.json and safetensors are read as data)", file=sys.stderr)
    return model


def _same_model(tokenizer: str, model: str | None) -> bool:
    if model is None:
        return False
    return tokenizer == model or (Path(tokenizer).is_dir() and Path(model).is_dir()
                                  and Path(tokenizer).resolve() == Path(model).resolve())


def _start_engine_process(args: EngineArgs, max_num_waiting: int, kv_transfer_factory: Any = None) -> Any:
    """The engine process of `deepinfer serve`, started, with its load line; an engine that cannot be
    built becomes _CommandError."""
    from .frontends.async_process import AsyncLLMProcess, EngineStartFailed

    _check_device(args)
    try:
        llm = AsyncLLMProcess(args, max_num_waiting=max_num_waiting, kv_transfer_factory=kv_transfer_factory)
    except (EngineStartFailed, *LOAD_ERRORS) as error:
        raise _CommandError(_one_line(error)) from None
    ready = llm.ready
    print(f"loaded {ready.model_dir} in {ready.load_seconds:.2f} s, {ready.weight_bytes / 2**20:.1f} MiB of weights "
          f"(engine process, pid {ready.pid})", file=sys.stderr)
    return llm


def _start_ranks(args: EngineArgs, max_num_waiting: int) -> Any:
    """The DP ranks of `deepinfer serve`, started, with their start line; a rank that fails to start
    becomes _CommandError."""
    from .parallel import DPAsyncLLM, RankFailure

    try:
        llm = DPAsyncLLM(args, max_num_waiting=max_num_waiting)
    except (RankFailure, *LOAD_ERRORS) as error:
        raise _CommandError(_one_line(error)) from None
    mode = " with expert parallel" if args.expert_parallel else ""
    print(f"started {args.data_parallel_size} DP ranks{mode} (pids {', '.join(map(str, llm.pids))}) serving "
          f"{llm.model.model_dir}", file=sys.stderr)
    return llm


# ---------------------------------------------------------------------------------------- engine

def _engine_args(ns: argparse.Namespace, parser: argparse.ArgumentParser, *, allow_data_parallel: bool = False,
                 kwargs: dict[str, Any] | None = None) -> tuple[dict[str, Any], EngineArgs]:
    """The engine flags given (to pass on; `kwargs` when the command already gathered them) and the
    EngineArgs they make (validated: a bad value is a usage error naming its flag;
    --data-parallel-size > 1 is one unless allow_data_parallel)."""
    kwargs = dataclass_kwargs(ns, EngineArgs) if kwargs is None else kwargs
    try:
        args = EngineArgs(**kwargs)
    except InvalidEngineArgs as error:
        where = f"argument {flag_name(error.field)}: " if error.field else ""
        parser.error(f"{where}{error}")
    if args.data_parallel_size > 1 and not allow_data_parallel:     # generate and bench drive one LLMEngine
        parser.error(f"argument --data-parallel-size: {args.data_parallel_size} is not supported by the deepinfer "
                     f"command yet for {ns.command} (one rank); use deepinfer serve, LLM(..., data_parallel_size=N) "
                     "from Python or a torchrun script")
    return kwargs, args


def _build(make: Any, args: EngineArgs) -> Any:
    """Build an LLM / LLMEngine with `make()`, print its load line; load failures become _CommandError."""
    _check_device(args)
    try:
        built = make()
    except LOAD_ERRORS as error:
        raise _CommandError(_one_line(error)) from None
    engine: LLMEngine = getattr(built, "engine", built)
    print(f"loaded {engine.model_dir} in {engine.load_seconds:.2f} s, {engine.weight_bytes / 2**20:.1f} MiB of "
          "weights", file=sys.stderr)
    return built


def _check_device(args: EngineArgs) -> None:
    import torch

    if args.device != AUTO and torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise _CommandError(f"device={args.device!r} needs CUDA, which this torch ({torch.__version__}) cannot use")


def _one_line(error: BaseException | str) -> str:
    return " ".join(str(error).split()) or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
