"""Chat templates: DeepSeek-V4's native format, jinja rendered as transformers renders it, the choice
of template per model folder, and LLM.chat on the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.text.chat_deepseek_v4 import TOOLS_SECTION, DeepseekV4ChatTemplate
from deepinfer.engine.text.chat_messages import InvalidChatRequest, parse_messages
from deepinfer.engine.text.chat_template import (
    ChatTemplateError,
    JinjaChatTemplate,
    PlainChatTemplate,
    load_chat_template,
)

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


def _v4(messages: list[dict], **options: object) -> str:
    return DeepseekV4ChatTemplate().render(parse_messages(messages), options=options)


def test_deepseek_v4_multi_turn_chat() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
                {"role": "user", "content": "2+2?"}]
    assert _v4(messages) == f"{B}Be brief.{U}Hi{A}</think>Hello!{E}{U}2+2?{A}</think>"


def test_deepseek_v4_thinking_keeps_only_the_current_turns_reasoning() -> None:
    messages = [{"role": "developer", "content": "old rules"}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
                {"role": "user", "content": "2+2?"}]
    assert _v4(messages, thinking=True) == f"{B}{U}Hi{A}</think>Hello!{E}{U}2+2?{A}<think>"
    prefilled = [*messages, {"role": "assistant", "content": "4", "reasoning_content": "add"}]
    assert _v4(prefilled, thinking=True) == f"{B}{U}Hi{A}</think>Hello!{E}{U}2+2?{A}<think>add</think>4{E}"


def test_deepseek_v4_tool_calls_and_results() -> None:
    call = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris", "days": 2}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "1"}, {"role": "tool", "content": "warm"}]
    dsml = "｜DSML｜"
    assert _v4(messages) == (
        f"{B}{U}Weather?{A}</think>\n\n<{dsml}tool_calls>\n<{dsml}invoke name=\"weather\">\n"
        f"<{dsml}parameter name=\"city\" string=\"true\">Paris</{dsml}parameter>\n"
        f"<{dsml}parameter name=\"days\" string=\"false\">2</{dsml}parameter>\n</{dsml}invoke>\n</{dsml}tool_calls>{E}"
        f"{U}<tool_result>sunny</tool_result>\n\n<tool_result>warm</tool_result>{A}</think>")


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def test_deepseek_v4_declares_tools_and_keeps_every_turns_reasoning() -> None:
    tools_section = TOOLS_SECTION.format(schemas='{"name": "weather", "parameters": {"type": "object"}}')
    assert tools_section.startswith("## Tools\n\nYou have access to a set of tools")
    assert '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>' \
        in tools_section
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
                {"role": "user", "content": "Weather?"}]
    rendered = DeepseekV4ChatTemplate().render(parse_messages(messages), options={"enable_thinking": True},
                                               tools=[TOOL])
    assert rendered == (f"{B}Be brief.\n\n{tools_section}{U}Hi{A}<think>greet</think>Hello!{E}"
                        f"{U}Weather?{A}<think>")
    assert _v4(messages[1:], thinking=False).startswith(f"{B}{U}Hi")
    no_system = DeepseekV4ChatTemplate().render(parse_messages(messages[1:2]), tools=[TOOL])
    assert no_system == f"{B}\n\n{tools_section}{U}Hi{A}</think>"


def test_plain_and_jinja_templates_get_the_tools() -> None:
    call = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = parse_messages([{"role": "user", "content": "Weather?"},
                               {"role": "assistant", "content": "", "tool_calls": [call]},
                               {"role": "tool", "content": "sunny"}])
    assert PlainChatTemplate().render(messages, tools=[TOOL]) == (
        'tools: {"name": "weather", "parameters": {"type": "object"}}\n\nuser: Weather?\n\n'
        'assistant: <tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>\n\n'
        "tool: sunny\n\nassistant:")
    names = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[1].tool_calls[0].function.arguments }}"
    assert JinjaChatTemplate(names).render(messages, tools=[TOOL]) == 'weather;{"city": "Paris"}'
    assert JinjaChatTemplate("{{ tools is none }}").render(messages, tools=[]) == "True"


def test_deepseek_v4_refuses_what_it_cannot_render() -> None:
    with pytest.raises(InvalidChatRequest) as caught:
        _v4([{"role": "narrator", "content": "x"}])
    assert caught.value.field == "messages[0].role"
    with pytest.raises(InvalidChatRequest) as caught:
        _v4([{"role": "user", "content": "x"}], reasoning_effort="max")
    assert caught.value.field == "chat_template_kwargs"


JINJA = """{{ bos_token }}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {%- if loop.index0 > 8 %}{% break %}{% endif %}
    <|{{ message.role }}|>
    {% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}{% else %}
    {{ message.content | trim }}
    {% endif %}
    {{ {"n": loop.index, "é": "ü"} | tojson }}
{% endfor %}
{%- if tools is not none %}TOOLS{% endif %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_jinja_renders_as_transformers_does(add_generation_prompt: bool) -> None:
    render_jinja_template = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    messages = [{"role": "system", "content": " sys "}, {"role": "user", "content": "hi\n"},
                {"role": "assistant", "content": "yo"}]
    ours = JinjaChatTemplate(JINJA, {"bos_token": "<s>", "eos_token": "</s>"}).render(
        parse_messages(messages), add_generation_prompt=add_generation_prompt)
    theirs, _ = render_jinja_template(conversations=[messages], chat_template=JINJA, bos_token="<s>",
                                      eos_token="</s>", add_generation_prompt=add_generation_prompt)
    assert ours == theirs[0]


def test_jinja_raise_exception_and_parse_errors() -> None:
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        JinjaChatTemplate(JINJA).render(parse_messages([{"role": "tool", "content": "x"}]))
    with pytest.raises(ChatTemplateError, match="does not parse"):
        JinjaChatTemplate("{% for %}")


def _folder(path: Path, *, config: dict | None = None, tokenizer_config: dict | None = None) -> Path:
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def test_the_template_is_chosen_from_the_folder(tmp_path: Path) -> None:
    v4 = _folder(tmp_path / "v4", config={"model_type": "deepseek_v4"})
    assert isinstance(load_chat_template(v4), DeepseekV4ChatTemplate)
    assert isinstance(load_chat_template(v4, embedded=True), PlainChatTemplate)
    jinja = _folder(tmp_path / "jinja", config={"model_type": "deepseek_v4"},
                    tokenizer_config={"chat_template": "{{ bos_token }}x", "bos_token": {"content": "<b>"}})
    template = load_chat_template(jinja)
    assert isinstance(template, JinjaChatTemplate)
    assert template.render(parse_messages([{"role": "user", "content": "y"}])) == "<b>x"
    assert isinstance(load_chat_template(jinja, override="deepseek_v4"), DeepseekV4ChatTemplate)
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}!")
    assert load_chat_template(jinja, override=str(tmp_path / "t.jinja")).render(
        parse_messages([{"role": "user", "content": "y"}])) == "y!"
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_chat_template(_folder(tmp_path / "other", config={"model_type": "llama"}))
    with pytest.raises(ChatTemplateError, match="neither a named template"):
        load_chat_template(jinja, override="chatml")


def test_llm_chat_on_the_embedded_model() -> None:
    llm = LLM(seed=0)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    params = SamplingParams(temperature=0, max_tokens=8)
    [out] = llm.chat(messages, params, use_tqdm=False)
    assert out.prompt == "system: You write Python.\n\nuser: def add(a, b):\n\nassistant:"
    [plain] = llm.generate({"prompt_token_ids": out.prompt_token_ids}, params, use_tqdm=False)
    assert out.outputs[0].text == plain.outputs[0].text and len(out.outputs[0].token_ids) == 8
    both = llm.chat([messages, messages[1:]], params, use_tqdm=False)
    assert both[0].outputs[0].text == out.outputs[0].text and both[1].prompt.startswith("user:")
    with pytest.raises(InvalidChatRequest):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], params)
    # tools reach the template (the plain template writes a `tools:` paragraph), checked as the server does
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    [with_tools] = llm.chat(messages, params, tools=[weather], use_tqdm=False)
    assert with_tools.prompt.startswith('tools: {"name": "get_weather"') and with_tools.prompt.endswith(out.prompt)
    with pytest.raises(InvalidChatRequest, match="is given twice") as err:
        llm.chat(messages, params, tools=[weather, weather])
    assert err.value.field == "tools[1].function.name"
