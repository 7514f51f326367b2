"""LLM: the offline entry point — `LLM(model=DIR).generate(prompts, sampling_params)` and
`LLM().chat(messages, sampling_params)`."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from deepinfer.sched import EngineType

from .config.engine_args import EngineArgs
from .config.env import read_torchrun_env
from .core.intake import PromptInput
from .core.outputs import OutputKind, RequestOutput
from .core.request import ParallelRequest, Request
from .frontends.core_loop import run_loop
from .llm_engine import LLMEngine, resolve_model_dir
from .sampling.sampling_params import SamplingParams
from .text.chat_messages import ChatMessage, parse_tool_list
from .text.chat_template import ChatTemplate, chat_prompt, load_chat_template
from .text.tokenizer import Tokenizer, load_tokenizer, require_tokenizer

if TYPE_CHECKING:
    from .parallel import DPRank, RebalanceStats, SpawnedRanks


class LLM:
    """Offline generation over one LLMEngine.

    Args:
        model: model folder, or a Hugging Face repo id in the local cache; None = the embedded default model.
        device: "auto" (CUDA when present, else CPU), "cpu" or "cuda[:N]".
        dtype: "auto" (float32 on CPU; bfloat16, or the config's float16, on CUDA), "float32",
            "bfloat16" or "float16".
        **engine_args: any other `EngineArgs` field (max_model_len, max_num_seqs, ...). Unlike
            `LLMEngine`, whose caller can retry, `LLM` recomputes preempted requests by default
            (stop_preempted_request=False) so that every prompt gets its full output.

    With data_parallel_size = N >= 2 (`deepinfer.engine.parallel`) the engines run in N rank processes,
    spawned here; under torchrun (WORLD_SIZE set) this process is one of the ranks instead, and every
    rank must call `generate` with the same prompts (each gets all the outputs). `engine` is then None
    (spawned) or this rank's engine (torchrun); `parallel` holds the ranks; call `close()` when done.

    `generate` calls from several threads run one at a time.
    """

    def __init__(self, model: str | None = None, device: str = "auto", dtype: str = "auto", **engine_args: Any):
        if engine_args.get("engine_type", EngineType.NORMAL) is not EngineType.COMPLETION:
            engine_args.setdefault("stop_preempted_request", False)
        args = EngineArgs(model=model, device=device, dtype=dtype, **engine_args)
        self.parallel: SpawnedRanks | DPRank | None = None
        self.engine: LLMEngine | None = None
        if args.data_parallel_size > 1:
            from .parallel import start_ranks

            self.parallel = start_ranks(args, read_torchrun_env())
            self.engine = getattr(self.parallel, "engine", None)
            self.model_dir = resolve_model_dir(args.resolved().model)
            self.tokenizer: Tokenizer | None = load_tokenizer(self.model_dir)
        else:
            self.engine = LLMEngine(args)
            self.model_dir, self.tokenizer = self.engine.model_dir, self.engine.tokenizer
        self._embedded = args.model is None
        self._lock = threading.Lock()
        self._chat_templates: dict[str | None, ChatTemplate] = {}

    @property
    def rebalances(self) -> tuple[RebalanceStats, ...]:
        """Expert re-placements (EPLB, `EngineArgs.eplb`) adopted so far, with the per-layer max / mean
        load before and after each; empty for one rank or without EPLB."""
        return () if self.parallel is None else self.parallel.rebalances

    def close(self) -> None:
        """Stop the DP ranks (no-op for one rank); the LLM cannot generate afterwards."""
        if self.parallel is not None:
            self.parallel.close()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order.

        Args:
            prompts: a string, a `{"prompt_token_ids": [...]}` dict, or a list of those.
            sampling_params: one SamplingParams for all prompts, or a list with one per prompt;
                None = SamplingParams() (16 tokens, temperature 1).
            use_tqdm: show a progress bar over finished requests.
        Raises:
            ValueError: a list of sampling params of the wrong length, or a bad prompt or request
                (every prompt is checked before any is queued: nothing runs then).
        On any exception (KeyboardInterrupt included) the requests of this call still running are
        aborted, so none of them runs inside a later call.
        """
        items = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"len(sampling_params)={len(params)} must equal len(prompts)={len(items)}")
        with self._lock:
            if self.parallel is not None:
                return self.parallel.generate(items, params)
            engine = self._single_engine()
            requests: list[Request | ParallelRequest] = []
            for i, (item, p) in enumerate(zip(items, params)):
                if not isinstance(item, str | dict):
                    raise ValueError(f"prompts[{i}] must be a str or a {{'prompt_token_ids': [...]}} dict")
                try:
                    requests.append(engine.prepare_request(None, item, p, output_kind=OutputKind.FINAL_ONLY))
                except ValueError as err:
                    err.args = (f"prompts[{i}]: {err}", *err.args[1:])   # same type, says which prompt
                    raise
            return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: Sequence[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate the next assistant turn of one conversation or of each of several.

        Args:
            messages: one conversation (a list of `{"role": ..., "content": ...}` dicts) or a list
                of conversations.
            sampling_params: as `generate` (one per conversation when a list).
            chat_template: a named template ("deepseek_v4", "plain") or a jinja file; None = the
                model folder's (see `chat_template.load_chat_template`).
            chat_template_kwargs: the template's options (e.g. {"thinking": True} for deepseek_v4).
            add_generation_prompt: end the prompt where the assistant's answer starts.
            tools: OpenAI tool objects (`{"type": "function", "function": {"name", "parameters", ...}}`)
                the template shows the model, as `deepinfer serve`'s chat endpoint does; the output is
                not parsed for calls here.
        Returns:
            One RequestOutput per conversation, in order; `prompt` holds the rendered text.
        Raises:
            InvalidChatRequest: a malformed message or option (`field` names it);
            ChatTemplateError: no usable template; ValueError: as `generate`.
        """
        one = not messages or isinstance(messages[0], dict | ChatMessage)
        conversations = [messages] if one else list(messages)
        template = self.chat_template(chat_template)
        tokenizer = require_tokenizer(self.tokenizer, self.model_dir)
        checked_tools = parse_tool_list(list(tools) if tools is not None else None)
        prompts = [chat_prompt(template, tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                               options=chat_template_kwargs, tools=checked_tools) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_template(self, override: str | None = None) -> ChatTemplate:
        """The chat template in use: `override` (a name or jinja file), else the model folder's."""
        if override not in self._chat_templates:
            self._chat_templates[override] = load_chat_template(self.model_dir, embedded=self._embedded,
                                                                override=override)
        return self._chat_templates[override]

    def _single_engine(self) -> LLMEngine:
        """This process's engine (every LLM has one, but one that spawned its DP ranks)."""
        if self.engine is None:
            raise RuntimeError("this LLM runs its data-parallel ranks in other processes: it has no engine here")
        return self.engine

    def _run(self, requests: list[Request | ParallelRequest], use_tqdm: bool) -> list[RequestOutput]:
        engine = self._single_engine()
        try:
            for req in requests:
                engine.enqueue(req)
            with tqdm(total=len(requests), disable=not use_tqdm, desc="generate", unit="req") as bar:
                batch = _OfflineBatch(engine, requests, bar)
                run_loop(engine.step, batch)
        except BaseException:
            for req in requests:
                if not req.finished:
                    engine.abort_request(req.request_id)
            engine.step()           # report (and forget) the aborted requests here, not later
            raise
        return batch.results()


class _OfflineBatch:
    """The `core_loop.Transport` of one `LLM.generate` call: its requests are queued up front; the
    loop steps until each has its finished output."""

    def __init__(self, engine: LLMEngine, requests: list[Request | ParallelRequest], bar: tqdm) -> None:
        self._engine, self._bar = engine, bar
        self._order = {req.request_id: i for i, req in enumerate(requests)}
        self._results: list[RequestOutput | None] = [None] * len(requests)
        self._missing = len(requests)

    def poll(self) -> None:
        """Nothing arrives during a call."""

    def has_work(self) -> bool:
        if not self._missing:
            return False
        if not self._engine.has_unfinished_requests():
            raise RuntimeError("the engine went idle before every request finished")
        return True

    def deliver(self, outputs: list[RequestOutput]) -> None:
        order, results = self._order, self._results
        for out in outputs:
            index = order.get(out.request_id) if out.finished else None
            if index is not None and results[index] is None:
                results[index] = out
                self._missing -= 1
                self._bar.update(1)

    def idle(self) -> bool:
        return False            # every request has its output: the call is done

    def results(self) -> list[RequestOutput]:
        return [r for r in self._results if r is not None]
