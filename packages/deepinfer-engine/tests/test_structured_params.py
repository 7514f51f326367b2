"""StructuredOutput / SamplingParams.structured: validation, normalisation and cache keys."""

from __future__ import annotations

import pytest

from deepinfer.engine import InvalidSamplingParams, SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"enum": ["x", "y"]}}}


def test_json_schema_dict_and_text_normalise_to_the_same_key_keeping_property_order() -> None:
    from_dict = StructuredOutput(json=SCHEMA)
    from_text = StructuredOutput(json='{ "type": "object",\n "properties": {"b": {"type": "boolean"}, '
                                      '"a": {"enum": ["x", "y"]}}}')
    assert from_dict.json == '{"type":"object","properties":{"b":{"type":"boolean"},"a":{"enum":["x","y"]}}}'
    assert from_dict == from_text and from_dict.key == from_text.key == ("json", from_dict.json)
    assert hash(SamplingParams(structured=from_dict)) == hash(SamplingParams(structured=from_text))
    assert StructuredOutput(json=True).json == "true"


def test_each_kind_and_its_key() -> None:
    assert StructuredOutput(regex=r"[0-9]{3}").key == ("regex", "[0-9]{3}")
    assert StructuredOutput(grammar='root ::= "a"').kind == "grammar"
    choice = StructuredOutput(choice=["yes", 'say "no"'])
    assert choice.choice == ("yes", 'say "no"') and choice.key == ("choice", '["yes", "say \\"no\\""]')
    assert choice.key != StructuredOutput(regex='["yes", "say \\"no\\""]').key
    params = SamplingParams(temperature=0, structured=choice)
    assert params.structured is choice and SamplingParams().structured is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, r"structured: exactly one of json, regex, grammar, choice must be set, got none"),
        ({"regex": "a", "choice": ["a"]}, r"exactly one of .* got \['regex', 'choice'\]"),
        ({"json": "{not json"}, r"structured.json is not valid JSON text"),
        ({"json": [1, 2]}, r"structured.json must be a JSON schema \(an object or a boolean\), got list"),
        ({"json": '"a string"'}, r"structured.json must be a JSON schema .* got str"),
        ({"json": {"maximum": float("nan")}}, r"structured.json cannot be written as JSON"),
        ({"json": {"type": object()}}, r"structured.json cannot be written as JSON"),
        ({"regex": ""}, r"structured.regex='' must be a non-empty str"),
        ({"grammar": 3}, r"structured.grammar=3 must be a non-empty str"),
        ({"choice": []}, r"structured.choice=\[\] must be a non-empty sequence of str"),
        ({"choice": "yes"}, r"structured.choice='yes' must be a non-empty sequence of str"),
        ({"choice": ["a", ""]}, r"structured.choice\[1\]='' must be a non-empty str"),
        ({"choice": ["a", 7]}, r"structured.choice\[1\]=7 must be a non-empty str"),
    ],
)
def test_bad_constraints_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidSamplingParams, match=message):
        StructuredOutput(**kwargs)


def test_sampling_params_checks_the_structured_field() -> None:
    with pytest.raises(InvalidSamplingParams, match=r"structured=\{'regex': 'a'\} must be None or a StructuredOutput"):
        SamplingParams(structured={"regex": "a"})
    with pytest.raises(InvalidSamplingParams, match=r"ignore_eos=True cannot be combined with structured"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput(regex="a"))


def test_structured_sizes_are_capped() -> None:
    from deepinfer.engine.sampling.sampling_params import MAX_CHOICES, MAX_STRUCTURED_CHARS
    limit = MAX_STRUCTURED_CHARS
    assert StructuredOutput(regex="a" * limit).regex == "a" * limit
    for kind, value in (("regex", "a" * (limit + 1)), ("grammar", "r" * (limit + 1)),
                        ("json", {"description": "x" * limit})):
        with pytest.raises(InvalidSamplingParams, match=rf"structured\.{kind} is \d+ characters; at most {limit}"):
            StructuredOutput(**{kind: value})
    with pytest.raises(InvalidSamplingParams, match=rf"structured\.choice holds {MAX_CHOICES + 1} strings"):
        StructuredOutput(choice=[str(i) for i in range(MAX_CHOICES + 1)])
    with pytest.raises(InvalidSamplingParams, match=r"structured\.choice strings hold \d+ characters"):
        StructuredOutput(choice=["a" * (limit // 2), "b" * (limit // 2 + 1)])
