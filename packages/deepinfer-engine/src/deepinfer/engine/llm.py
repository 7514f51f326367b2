"""LLM: the offline entry point — `LLM(model=DIR).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from .engine_args import EngineArgs
from .llm_engine import LLMEngine, PromptInput
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """Offline generation over one LLMEngine.

    Args:
        model: model folder; None = the embedded default model.
        device: "cpu" or "cuda[:N]".
        dtype: "float32", "bfloat16" or "float16".
        **engine_args: any other `EngineArgs` field (max_model_len, max_num_seqs, ...).
    """

    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str = "float32", **engine_args: Any):
        self.engine = LLMEngine(EngineArgs(model=model, device=device, dtype=dtype, **engine_args))

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
            ValueError: a list of sampling params of the wrong length, or a malformed prompt (checked
                for every prompt before any is queued).
        """
        items = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"len(sampling_params)={len(params)} must equal len(prompts)={len(items)}")
        for i, item in enumerate(items):
            if not isinstance(item, str | dict):
                raise ValueError(f"prompts[{i}] must be a str or a {{'prompt_token_ids': [...]}} dict")
            self.engine.tokenize_prompt(item)
        ids = [self.engine.add_request(None, item, p) for item, p in zip(items, params)]
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate", unit="req") as bar:
            while any(r is None for r in results):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine went idle before every request finished")
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        return [r for r in results if r is not None]
