from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from deepinfer.engine.sampling.sampling_params import (
    GREEDY_TEMPERATURE,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MIN_PROBABILITY_CUT,
    InvalidSamplingParams,
    SamplingParams,
)


def test_defaults() -> None:
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (1.0, -1, 1.0, 0.0)
    assert (params.max_tokens, params.min_tokens, params.seed, params.logprobs) == (16, 0, None, None)
    assert params.stop == () and params.stop_token_ids == ()
    assert not params.ignore_eos and not params.include_stop_str_in_output
    assert not params.is_greedy and not params.top_k_enabled


def test_stop_and_stop_token_ids_are_normalised_to_tuples() -> None:
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    params = SamplingParams(stop_token_ids=[3, np.int64(7)])
    assert params.stop_token_ids == (3, 7) and type(params.stop_token_ids[1]) is int


def test_numpy_scalars_become_python_numbers() -> None:
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int32(4), max_tokens=np.int64(9))
    assert type(params.temperature) is float and type(params.top_k) is int and type(params.max_tokens) is int


@pytest.mark.parametrize(("temperature", "greedy"), [(0, True), (0.0, True), (5e-6, True), (1e-5, False),
                                                      (0.7, False)])
def test_greedy_below_threshold(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_valid_edges_are_accepted() -> None:
    SamplingParams(top_k=0)
    SamplingParams(top_k=1)
    SamplingParams(top_p=1.0, min_p=1.0)
    SamplingParams(min_p=0.0, max_tokens=None, min_tokens=1000)
    SamplingParams(max_tokens=1, min_tokens=1)
    SamplingParams(seed=0, logprobs=0)
    SamplingParams(seed=2**64 - 1, logprobs=20)
    SamplingParams(temperature=1e4, top_p=1e-20, min_p=1e-20)
    SamplingParams(temperature=1e-300)                   # below 1e-5: greedy, never divided by
    SamplingParams(max_tokens=2**31 - 1, min_tokens=2**31 - 1, top_k=2**31 - 1)
    SamplingParams(stop=["x" * MAX_STOP_STRING_LEN] * MAX_STOP_STRINGS,
                   stop_token_ids=[2**31 - 1] * MAX_STOP_TOKEN_IDS)


def test_float_bounds_are_normal_nonzero_float32_values() -> None:
    """The sampler rounds temperature, top_p and min_p to float32: every allowed value stays a
    normal, finite float32, and the smallest temperature cannot overflow the logits it divides."""
    tiny = np.finfo(np.float32).tiny
    for value in (GREEDY_TEMPERATURE, MAX_TEMPERATURE, MIN_PROBABILITY_CUT):
        assert tiny <= np.float32(value) < np.finfo(np.float32).max
    # top_p / min_p times a probability >= 2**-31 (1 / vocab) stays normal.
    assert np.float32(MIN_PROBABILITY_CUT) * np.float32(2.0**-31) >= tiny


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, r"temperature=-0.1 must be >= 0"),
        ({"temperature": float("nan")}, r"temperature=nan must be finite"),
        ({"temperature": "1"}, r"temperature='1' must be a float"),
        ({"top_k": -2}, r"top_k=-2 must be -1 or 0 \(off\) or >= 1"),
        ({"top_k": 2.0}, r"top_k=2.0 must be an int"),
        ({"top_k": True}, r"top_k=True must be an int"),
        ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"min_p": -0.01}, r"min_p=-0.01 must be in \[0, 1\]"),
        ({"min_p": 1.01}, r"min_p=1.01 must be in \[0, 1\]"),
        ({"max_tokens": 0}, r"max_tokens=0 must be >= 1 \(or None = until max_model_len\)"),
        ({"min_tokens": -1}, r"min_tokens=-1 must be >= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens=5 must be <= max_tokens=4"),
        ({"stop": ["ok", ""]}, r"stop\[1\]='' must be a non-empty str"),
        ({"stop": ""}, r"stop\[0\]='' must be a non-empty str"),
        ({"stop": [1]}, r"stop\[0\]=1 must be a str"),
        ({"stop": 5}, r"stop=5 must be a str or a sequence of str"),
        ({"stop_token_ids": [1, -1]}, r"stop_token_ids\[1\]=-1 must be an int >= 0"),
        ({"stop_token_ids": "12"}, r"stop_token_ids='12' must be a sequence of int"),
        ({"ignore_eos": 1}, r"ignore_eos=1 must be a bool"),
        ({"seed": -1}, r"seed=-1 must be None or in \[0, 2\*\*64 - 1\]"),
        ({"seed": 2**64}, r"seed=18446744073709551616 must be None or in"),
        ({"logprobs": 21}, r"logprobs=21 must be None or in \[0, 20\]"),
        ({"logprobs": -1}, r"logprobs=-1 must be None or in \[0, 20\]"),
        ({"include_stop_str_in_output": None}, r"include_stop_str_in_output=None must be a bool"),
        ({"temperature": 1e39}, r"temperature=1e\+39 must be >= 0 and <= 10000 \(0, or anything below 1e-05"),
        ({"temperature": 10000.5}, r"temperature=10000.5 must be >= 0 and <= 10000"),
        ({"temperature": float("inf")}, r"temperature=inf must be finite"),
        ({"top_p": 1e-46}, r"top_p=1e-46 must be in \(0, 1\], and >= 1e-20 \(a smaller cut is 0 or a denormal"),
        ({"top_p": 9e-21}, r"top_p=9e-21 must be in \(0, 1\], and >= 1e-20"),
        ({"top_p": float("nan")}, r"top_p=nan must be finite"),
        ({"min_p": 1e-40}, r"min_p=1e-40 must be in \[0, 1\], and 0 or >= 1e-20"),
        ({"min_p": float("-inf")}, r"min_p=-inf must be finite"),
        ({"top_k": 2**31}, r"top_k=2147483648 must be -1 or 0 \(off\) or >= 1 \(at most 2147483647\)"),
        ({"max_tokens": 2**31}, r"max_tokens=2147483648 must be >= 1 \(or None = until max_model_len\) and "
                                r"<= 2147483647"),
        ({"max_tokens": None, "min_tokens": 2**31}, r"min_tokens=2147483648 must be >= 0 and <= 2147483647"),
        ({"stop": ["s"] * 65}, r"stop has 65 strings: at most 64 are allowed"),
        ({"stop": ["ok", "a" * 200_000]}, r"stop\[1\] has 200000 characters: at most 1024 are allowed"),
        ({"stop": "a" * 1025}, r"stop\[0\] has 1025 characters: at most 1024 are allowed"),
        ({"stop_token_ids": list(range(1025))}, r"stop_token_ids has 1025 ids: at most 1024 are allowed"),
        ({"stop_token_ids": [2**31]}, r"stop_token_ids\[0\]=2147483648 must be an int >= 0 and <= 2147483647"),
    ],
)
def test_invalid_values_name_field_and_range(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidSamplingParams, match=message):
        SamplingParams(**kwargs)


def test_invalid_sampling_params_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        SamplingParams(top_p=2)


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.0  # type: ignore[misc]
