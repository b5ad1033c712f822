"""Parameters Tessera does not serve yet, and names it does not know, are refused by name; their
"off" values (null for an unknown name) and parameters that change no answer are accepted."""

import pytest
from pydantic import ValidationError

from services.gateway.protocol import ChatCompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "name, value",
    [
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("suffix", "the end"),
    ],
)
def test_an_unsupported_parameter_is_refused_by_name(name: str, value: object) -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(**CHAT, **{name: value})
    assert f"`{name}` is not supported" in str(e.value)


@pytest.mark.parametrize(
    "name, value",
    [
        ("response_format", {"type": "text"}),
        ("tools", []),
        ("tool_choice", "none"),
        ("logprobs", False),
        ("logprobs", None),
        ("logit_bias", {}),
        ("best_of", 1),
        ("parallel_tool_calls", True),
        ("some_future_field", None),
        ("metadata", {"run": "7"}),
        ("store", True),
        ("service_tier", "auto"),
        ("functions", []),
        ("function_call", "none"),
        ("suffix", None),
    ],
)
def test_off_values_and_unknown_names_are_accepted(name: str, value: object) -> None:
    ChatCompletionRequest(**CHAT, **{name: value})


@pytest.mark.parametrize("name, value", [("some_future_field", 1), ("max_token", 16), ("modalities", ["audio"])])
def test_an_unknown_name_is_refused_by_name_not_ignored(name: str, value: object) -> None:
    # OpenAI's server answers "Unrecognized request argument supplied"; ignoring a misspelt
    # `max_token` would answer as if it had been honoured.
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(**CHAT, **{name: value})
    assert f"unrecognized request argument supplied: `{name}`" in str(e.value)


def test_penalties_are_range_checked() -> None:
    ChatCompletionRequest(**CHAT, frequency_penalty=2.0, presence_penalty=-2.0, top_k=-1, min_p=0.0)
    for bad in ({"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"top_k": -2}, {"min_p": 1.5}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(**CHAT, **bad)


@pytest.mark.parametrize(
    "bad, param",
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"best_of": 2, "n": 3}, "best_of"),
        ({"best_of": 3, "stream": True}, "stream"),
        ({"logit_bias": {"the": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"top_logprobs": 3}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tool_choice": "required"}, "tool"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "g",
        ),
    ],
)
def test_choices_bias_logprobs_and_tools_are_checked(bad: dict[str, object], param: str) -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(**CHAT, **bad)
    assert param in str(e.value)


def test_a_list_of_prompts_times_its_choices_is_bounded() -> None:
    from services.gateway.protocol import MAX_CHOICES, CompletionRequest

    ok = CompletionRequest(model="m", prompt=["a", "b"], n=2)
    assert ok.prompts() == ["a", "b"] and ok.candidates() == 2
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt=["a"] * MAX_CHOICES, n=2)
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt=[])
