"""Parameters Tessera does not serve yet are refused by name; their "off" values, and names it
does not know, are accepted."""

import pytest
from pydantic import ValidationError

from services.gateway.protocol import ChatCompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("name, value", [
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "required"),
    ("logprobs", True),
    ("top_logprobs", 3),
    ("logit_bias", {"42": -100}),
    ("best_of", 2),
    ("structured_outputs", {"json": {}}),
])
def test_an_unsupported_parameter_is_refused_by_name(name: str, value: object) -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(**CHAT, **{name: value})
    assert f"`{name}` is not supported" in str(e.value)


@pytest.mark.parametrize("name, value", [
    ("response_format", {"type": "text"}), ("tools", []), ("tool_choice", "none"), ("logprobs", False),
    ("logprobs", None), ("logit_bias", {}), ("best_of", 1), ("parallel_tool_calls", True),
    ("some_future_field", 1),
])
def test_off_values_and_unknown_names_are_accepted(name: str, value: object) -> None:
    ChatCompletionRequest(**CHAT, **{name: value})


def test_penalties_are_range_checked() -> None:
    ChatCompletionRequest(**CHAT, frequency_penalty=2.0, presence_penalty=-2.0, top_k=-1, min_p=0.0)
    for bad in ({"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"top_k": -2}, {"min_p": 1.5}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(**CHAT, **bad)
