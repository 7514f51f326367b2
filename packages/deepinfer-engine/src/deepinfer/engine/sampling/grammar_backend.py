"""Grammar back end: compiles a `StructuredOutput` with xgrammar; `GrammarState` follows one request.

xgrammar is optional (the `structured` extra). `XGrammarBackend` only checks that it is installed
when built; the import itself (it pulls in transformers, seconds) happens on the first compile, on a
compile-pool thread, so no request waits for it on the step loop.
"""

from __future__ import annotations

import importlib.util
import re
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from torch import Tensor

from ..text.tokenizer import Tokenizer
from .sampling_params import StructuredOutput

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "; the reason keeps the rest.
_SOURCE_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


class GrammarCompileError(ValueError):
    """A constraint could not be compiled; the message says which kind and why."""


class StructuredOutputUnavailable(RuntimeError):
    """Structured output was asked for but cannot work here (no xgrammar, no tokenizer or no EOS)."""


class StaleGrammarError(RuntimeError):
    """A token mask was about to be built from a grammar state that has not consumed the request's
    previous tokens (the overlap bug docs/design.md §11 rules out)."""


class GrammarState:
    """Where one request stands in its grammar: an xgrammar `GrammarMatcher` plus a token count.

    Args:
        matcher: a matcher of the request's compiled grammar, in its initial state.
    """

    __slots__ = ("_matcher", "num_accepted")

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self.num_accepted = 0          # tokens accepted so far (EOS included once accepted)

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance over `token_ids` in order, stopping at the first one the grammar rejects.

        Returns:
            How many tokens were accepted (a prefix of token_ids); the state is after them.
        """
        num_accepted = 0
        for token_id in token_ids:
            if not self._matcher.accept_token(int(token_id)):
                break
            num_accepted += 1
        self.num_accepted += num_accepted
        return num_accepted

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (e.g. drafts a verify step rejected).

        Raises:
            ValueError: num_tokens is not in [0, num_accepted].
        """
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"num_tokens={num_tokens} must be in [0, num_accepted={self.num_accepted}]")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: Tensor, row: int, *, expected_num_tokens: int) -> None:
        """Write the next token's mask into bitmask[row] (int32 CPU, bit t % 32 of word t // 32 set =
        token t allowed).

        Args:
            expected_num_tokens: output tokens the request has; the state must have consumed all.
        Raises:
            StaleGrammarError: num_accepted != expected_num_tokens.
        """
        if self.num_accepted != expected_num_tokens:
            raise StaleGrammarError(
                f"grammar state has consumed {self.num_accepted} tokens but the request has "
                f"{expected_num_tokens}: the previous step was not post-processed before this mask"
            )
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token (EOS) was accepted."""
        return bool(self._matcher.is_terminated())


class GrammarBackend(Protocol):
    """Compiles constraints and makes per-request grammar states; `compile` runs on pool threads."""

    def compile(self, spec: StructuredOutput) -> object:
        """Blocking compile; returns an opaque compiled grammar. Raises GrammarCompileError."""

    def new_state(self, compiled: object) -> GrammarState:
        """A fresh state (the grammar's start) of a grammar `compile` returned."""


def xgrammar_installed() -> bool:
    """Whether the xgrammar package can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("xgrammar") is not None
    except (ImportError, ValueError):
        return False


class XGrammarBackend:
    """`GrammarBackend` over xgrammar for one tokenizer.

    Args:
        tokenizer: the engine's tokenizer (tokenizer.json through the `tokenizers` library).
        vocab_size: the model's vocabulary (logits width); ids the tokenizer lacks are never allowed.
        stop_token_ids: ids that end a completed grammar (the engine's EOS ids), non-empty.
        max_threads: xgrammar's own threads per compile.

    Raises:
        StructuredOutputUnavailable: xgrammar is not installed, or stop_token_ids is empty.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int], *,
                 max_threads: int = 1) -> None:
        if not xgrammar_installed():
            raise StructuredOutputUnavailable(
                "SamplingParams.structured needs the xgrammar package (a dependency of deepinfer-engine, missing "
                "from this environment): pip install 'xgrammar>=0.2.8,<0.3'"
            )
        if not stop_token_ids:
            raise StructuredOutputUnavailable("structured output needs an EOS token id; the model defines none")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = [int(t) for t in stop_token_ids]
        self._max_threads = max_threads
        self._lock = threading.Lock()
        self._compiler: Any = None

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar
                from transformers import PreTrainedTokenizerFast

                wrapped = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
                info = xgrammar.TokenizerInfo.from_huggingface(
                    wrapped, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids)
                # Compiled grammars are cached by GrammarCompilePool; a second cache would only hold copies.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutput) -> object:
        """Compile `spec` (blocking). Raises GrammarCompileError naming the kind and xgrammar's reason."""
        compiler = self._get_compiler()
        kind = spec.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec.json, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "grammar":
                return compiler.compile_grammar(spec.grammar)
            return compiler.compile_grammar(choice_ebnf(spec.choice or ()))
        except (RuntimeError, ValueError) as error:
            reason = _SOURCE_PREFIX.sub("", str(error)).strip() or type(error).__name__
            raise GrammarCompileError(f"invalid structured.{kind}: {reason}") from error

    def new_state(self, compiled: Any) -> GrammarState:   # an xgrammar.CompiledGrammar from `compile`
        import xgrammar

        return GrammarState(xgrammar.GrammarMatcher(compiled))


def choice_ebnf(choices: Sequence[str]) -> str:
    """A GBNF grammar whose root matches exactly one of `choices` (every character escaped)."""
    return "root ::= " + " | ".join(f'"{_ebnf_escape(choice)}"' for choice in choices)


def _ebnf_escape(text: str) -> str:
    out = []
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif 0x20 <= code < 0x7F:
            out.append(char)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "".join(out)
