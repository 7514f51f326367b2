"""Chat templates: messages -> one prompt string.

Three kinds, chosen by `load_chat_template`:

- a jinja template from the model folder's tokenizer_config.json `chat_template`, rendered as
  transformers renders it (sandboxed, trim_blocks / lstrip_blocks, `raise_exception`, `tojson`,
  `strftime_now`, the `{% generation %}` tag, bos/eos tokens, add_generation_prompt);
- a named template written natively: "deepseek_v4" (DeepSeek-V4's own encoder,
  `chat_deepseek_v4`), chosen for a folder whose config.json says model_type "deepseek_v4" and
  that has no jinja template;
- "plain", `role: content` lines ending with "assistant:", for the embedded default model (a
  small code model with no chat tokens) so that chat works offline.

Every kind takes the request's `tools` (OpenAI tool objects): jinja templates read them as the
`tools` variable (None when there are none, as in transformers), "deepseek_v4" renders them in
DeepSeek's own way, "plain" as a `tools:` paragraph of JSON with assistant tool calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (what the "hermes" tool parser reads).

The rendered prompt carries its own special tokens (BOS, role markers): tokenize it with
add_special_tokens=False.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from .chat_messages import ChatMessage, InvalidChatRequest, parse_messages
from .tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """A chat template cannot be loaded, or raised an error while rendering (`raise_exception`)."""


class ChatTemplate(Protocol):
    name: str

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
               options: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text; `options` are the template's extra keyword variables (chat_template_kwargs),
        `tools` the OpenAI tool objects the model may call (None or empty: no tools).

        Raises:
            InvalidChatRequest: the messages or options do not fit this template.
            ChatTemplateError: the template itself failed.
        """


class PlainChatTemplate:
    """`role: content` paragraphs, then `assistant:` (the embedded model's template). No options."""

    name = "plain"

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
               options: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        if options:
            raise InvalidChatRequest(f"chat_template_kwargs: the plain chat template takes no options, got "
                                     f"{sorted(options)}", "chat_template_kwargs")
        text = "".join(f"tools: {json.dumps(tool.get('function'), ensure_ascii=False)}\n\n" for tool in tools or ())
        for m in messages:
            calls = "".join(f'<tool_call>{{"name": {json.dumps(c.name, ensure_ascii=False)}, "arguments": '
                            f"{c.arguments}}}</tool_call>" for c in m.tool_calls)
            text += f"{m.role}: {m.content}{calls}\n\n"
        return text + "assistant:" if add_generation_prompt else text


class JinjaChatTemplate:
    """A Hugging Face jinja chat template.

    Args:
        source: the template text.
        special_tokens: variables such as bos_token / eos_token, passed to every render.
    Raises:
        ChatTemplateError: the template does not parse.
    """

    name = "jinja"

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class _Generation(jinja2.ext.Extension):
            """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): the body as is."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.Scope(body, lineno=lineno)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat_template does not parse: {error}") from None
        self._special = dict(special_tokens or {})

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
               options: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        import jinja2

        # tools / documents are None unless given, as in transformers (`tools is not none` must be false).
        variables = {"documents": None, **self._special, **(options or {}), "tools": list(tools) if tools else None,
                     "messages": [m.to_dict() for m in messages], "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat_template failed: {error}") from None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat_template: {message}")


def _deepseek_v4() -> ChatTemplate:
    from .chat_deepseek_v4 import DeepseekV4ChatTemplate
    return DeepseekV4ChatTemplate()


NAMED_TEMPLATES: dict[str, Callable[[], ChatTemplate]] = {"deepseek_v4": _deepseek_v4, "plain": PlainChatTemplate}
# config.json model_type -> the named template used when the folder has no jinja template.
MODEL_TYPE_TEMPLATES = {"deepseek_v4": "deepseek_v4"}


def load_chat_template(model_dir: str | Path, *, embedded: bool = False, override: str | None = None) -> ChatTemplate:
    """The chat template of a model folder.

    Args:
        model_dir: the model folder.
        embedded: the folder is the embedded default model ("plain" unless it has a jinja template).
        override: a named template ("deepseek_v4", "plain") or a path to a jinja file; None = choose.
    Raises:
        ChatTemplateError: nothing to choose (no jinja template and a model type without a named
            one), an unknown name, an unreadable file or a template that does not parse.
    """
    folder = Path(model_dir)
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    special = {key: value for key in ("bos_token", "eos_token", "pad_token", "unk_token")
               if isinstance(value := _token_text(tokenizer_config.get(key)), str)}
    if override is not None:
        if override in NAMED_TEMPLATES:
            return NAMED_TEMPLATES[override]()
        path = Path(override)
        if not path.is_file():
            raise ChatTemplateError(f"chat_template={override!r} is neither a named template "
                                    f"({', '.join(NAMED_TEMPLATES)}) nor a file")
        return JinjaChatTemplate(path.read_text(encoding="utf-8"), special)
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):     # [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(source, str):
        return JinjaChatTemplate(source, special)
    if embedded:
        return PlainChatTemplate()
    model_type = _read_json(folder / "config.json").get("model_type")
    if model_type in MODEL_TYPE_TEMPLATES:
        return NAMED_TEMPLATES[MODEL_TYPE_TEMPLATES[model_type]]()
    raise ChatTemplateError(f"{folder} has no chat template (tokenizer_config.json chat_template) and model_type="
                            f"{model_type!r} has no named one; pass a chat template ({', '.join(NAMED_TEMPLATES)} or "
                            "a jinja file)")


def _token_text(value: object) -> object:
    return value.get("content") if isinstance(value, dict) else value    # a serialised AddedToken


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ChatTemplateError(f"{path}: cannot be read as JSON: {error}") from None
    return data if isinstance(data, dict) else {}


def chat_prompt(template: ChatTemplate, tokenizer: Tokenizer, messages: object, *, add_generation_prompt: bool = True,
                options: Mapping[str, Any] | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Render OpenAI-shaped `messages` (and the `tools` the model may call) and tokenize them (no
    special tokens added: the template wrote them); returns `{"prompt": text, "prompt_token_ids":
    [int, ...]}` for `add_request`.

    Raises:
        InvalidChatRequest / ChatTemplateError: as `parse_messages` and `ChatTemplate.render`.
    """
    text = template.render(parse_messages(messages), add_generation_prompt=add_generation_prompt, options=options,
                           tools=tools)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
