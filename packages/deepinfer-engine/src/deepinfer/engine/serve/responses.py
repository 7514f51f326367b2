"""Engine outputs -> OpenAI response bodies and server-sent-event chunks, for both endpoints.

Finish reasons pass through ("stop", "length", "abort", "error"); "preempted" is reported as
"abort" (the client may retry). Logprobs follow OpenAI's two shapes: completions
`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, chat
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`. prompt_logprobs (vLLM's
extension) are a choice field: `[null, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...]`,
in a stream on the first chunk of each choice.

With n > 1 samples there is one choice per sample (`index` 0..n − 1); a stream interleaves the
samples' chunks as they come, each chunk carrying one choice, as OpenAI does.

A chat request with output parsers (`chat_output`) gets `reasoning_content` and `tool_calls` in its
message (or its deltas) and finish_reason "tool_calls" when it called a tool.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from typing import Any

from ..core.outputs import FINISH_PREEMPTED, CompletionOutput, RequestOutput
from ..text.tokenizer import Tokenizer
from .chat_output import ChoiceStream, OutputParsers
from .protocol import GenerateRequest

DONE = "data: [DONE]\n\n"
_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as compact JSON."""
    return f"data: {_json(payload)}\n\n"


def finish_reason(completion: CompletionOutput, *, tool_calls: bool = False) -> str | None:
    """The OpenAI finish reason; "tool_calls" for an output that called tools and stopped by itself."""
    reason = completion.finish_reason
    if tool_calls and reason == "stop":
        return "tool_calls"
    return "abort" if reason == FINISH_PREEMPTED else reason


class ResponseWriter:
    """Writes one request's response (streamed or whole).

    Args:
        request_id: the response id ("cmpl-..." / "chatcmpl-...").
        model: the served model name.
        chat: chat.completion shapes (else text_completion).
        req: the checked request (stream options, logprobs count).
        tokenizer: decodes logprob tokens; None = token ids are shown as "token_id:N".
        parsers: chat only: splits reasoning and tool calls out of the output; None = all is content.
    """

    def __init__(self, request_id: str, model: str, chat: bool, req: GenerateRequest,
                 tokenizer: Tokenizer | None, parsers: OutputParsers | None = None) -> None:
        self._id, self._model, self._chat, self._req = request_id, model, chat, req
        self._parsers = parsers
        self._streams: dict[int, ChoiceStream] = {}   # per choice index, with parsers
        self._created = int(time.time())
        # The common chunk (text of one choice, nothing else) is written as `sse(self._chunk(choice))`
        # would write it, from a prefix made once: the per-token JSON is the text alone.
        self._plain_prefix = sse(self._chunk({}))[:-len("{}]}\n\n")] + (
            '{"index":0,"delta":{"content":' if chat else '{"index":0,"text":')
        self._plain_suffix = ('}' if chat else '') + ',"logprobs":null,"finish_reason":null}]}\n\n'
        self._text_offsets: dict[int, int] = {}      # per choice index: completions logprobs' text_offset
        self._finished: set[int] = set()             # choice indices whose finish chunk is sent
        self._prompt_logprobs_sent: set[int] = set()  # choice indices whose chunk carried prompt_logprobs
        self._token_text = functools.lru_cache(maxsize=4096)(
            (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer is not None
            else (lambda t: f"token_id:{t}"))

    # ------------------------------------------------------------------ streaming

    def start(self) -> Iterator[str]:
        """The chunks before any text (chat: the assistant role)."""
        if self._chat:
            for index in range(self._req.params.n):
                yield sse(self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}))

    def delta(self, out: RequestOutput) -> Iterator[str]:
        """The chunks of one delta output, one per sample with new text or tokens or a new finish."""
        outputs = out.outputs
        if len(outputs) == 1 and self._parsers is None and not out.prompt_logprobs:
            completion = outputs[0]
            if completion.text and completion.finish_reason is None and completion.logprobs is None:
                yield f"{self._plain_prefix}{_json(completion.text)}{self._plain_suffix}"
                return
        for completion in outputs:
            choice = self._delta_choice(out, completion)
            if choice is not None:
                yield sse(self._chunk(choice))

    def _delta_choice(self, out: RequestOutput, completion: CompletionOutput) -> dict[str, Any] | None:
        """One sample's choice of a delta chunk; None when it has nothing new (or its text is held back)."""
        index = completion.index
        finished = completion.finished and index not in self._finished
        if not completion.text and not completion.token_ids and not finished:
            return None
        logprobs = self._logprobs(completion)
        calls = False
        if self._chat and self._parsers is not None:
            stream = self._streams.setdefault(index, ChoiceStream(self._parsers))
            choice: dict[str, Any] = {"index": index, "delta": stream.delta(completion.text, final=completion.finished)}
            calls = stream.has_tool_calls
            if not choice["delta"] and not finished and logprobs is None:
                return None                   # held back: may be the start of a marker
        elif self._chat:
            choice = {"index": index, "delta": {"content": completion.text} if completion.text else {}}
        else:
            choice = {"index": index, "text": completion.text}
        choice.update(logprobs=logprobs, finish_reason=finish_reason(completion, tool_calls=calls))
        if out.prompt_logprobs and index not in self._prompt_logprobs_sent:
            self._prompt_logprobs_sent.add(index)
            choice["prompt_logprobs"] = _prompt_logprobs(out)
        if finished:
            self._finished.add(index)
            choice["stop_reason"] = completion.stop_reason
            if completion.error_reason is not None:      # finish_reason "error": say why
                choice["error_reason"] = completion.error_reason
        return choice

    def end(self, num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> Iterator[str]:
        """The usage chunk (when asked for) and `data: [DONE]`."""
        if self._req.include_usage:
            usage = _usage(num_prompt_tokens, num_output_tokens, num_cached_tokens)
            yield sse({**self._chunk(None), "choices": [], "usage": usage})
        yield DONE

    # ------------------------------------------------------------------ whole

    def full(self, last: RequestOutput) -> dict[str, Any]:
        """The non-streamed response body for the final (cumulative) output: one choice per sample."""
        choices = []
        for completion in last.outputs:
            choice: dict[str, Any] = {"index": completion.index}
            if self._chat and self._parsers is not None:
                choice["message"] = self._parsers.message(completion.text)
            elif self._chat:
                choice["message"] = {"role": "assistant", "content": completion.text}
            else:
                choice["text"] = completion.text
            calls = bool(choice.get("message", {}).get("tool_calls"))
            choice.update(logprobs=self._logprobs(completion),
                          finish_reason=finish_reason(completion, tool_calls=calls), stop_reason=completion.stop_reason)
            if completion.error_reason is not None:          # finish_reason "error": say why
                choice["error_reason"] = completion.error_reason
            if last.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _prompt_logprobs(last)
            choices.append(choice)
        return {"id": self._id, "object": "chat.completion" if self._chat else "text_completion",
                "created": self._created, "model": self._model, "choices": choices,
                "usage": _usage(len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs),
                                last.num_cached_tokens)}

    # ------------------------------------------------------------------ pieces

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": self._id, "object": "chat.completion.chunk" if self._chat else "text_completion",
                "created": self._created, "model": self._model, "choices": [] if choice is None else [choice]}

    def _logprobs(self, completion: CompletionOutput) -> dict[str, Any] | None:
        if completion.logprobs is None:
            return None
        top_n = self._req.params.logprobs or 0
        entries = []
        for token_id, alternatives in zip(completion.token_ids, completion.logprobs):
            ranked = sorted(alternatives.items(), key=lambda item: (-item[1], item[0]))[:top_n]
            entries.append((token_id, alternatives[token_id], ranked))
        text = self._token_text
        if self._chat:
            return {"content": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode()),
                                 "top_logprobs": [{"token": text(a), "logprob": alp, "bytes": list(text(a).encode())}
                                                  for a, alp in ranked]}
                                for t, lp, ranked in entries]}
        offsets = []
        offset = self._text_offsets.get(completion.index, 0)
        for token_id, _, _ in entries:
            offsets.append(offset)
            offset += len(text(token_id))
        self._text_offsets[completion.index] = offset
        return {"tokens": [text(t) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{text(a): alp for a, alp in ranked} for _, _, ranked in entries],
                "text_offset": offsets}


def _prompt_logprobs(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None]:
    return [None if entry is None else
            {str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in entry.items()}
            for entry in out.prompt_logprobs or ()]


def _usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}
