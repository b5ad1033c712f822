"""Structured output and tools through the official `openai` client, enforced by the engine's
grammar on the real 135M model: the JSON validates however small the model."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel

from ops.localcluster import LocalCluster, default_model_path
from tests.helpers.json_prefix import is_object_prefix

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "now", "description": "The time", "parameters": {"type": "object", "properties": {}}},
}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str
    age: int


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client: openai.OpenAI, model: str, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=60, temperature=0, response_format=fmt, stream=stream
    )  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else r.choices[0].message.content
    jsonschema_rs.validate(PERSON, json.loads(text))


def test_json_object_output_is_an_object(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=200, temperature=0, response_format={"type": "json_object"}
    )
    text = r.choices[0].message.content or ""
    if r.choices[0].finish_reason == "stop":  # the grammar lets it end only once the object is closed
        assert isinstance(json.loads(text), dict), text
    else:  # cut off by max_tokens (how long an object the model writes is its own): still JSON
        assert r.choices[0].finish_reason == "length"
        assert is_object_prefix(text), text


def test_parse_with_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.parse(model=model, messages=ASK, max_tokens=60, temperature=0, response_format=Person)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person) and parsed.name


def test_vllm_structured_outputs_regex_and_choice(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model,
        prompt="A phone number:",
        max_tokens=12,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
    )
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is the sky green?"}],
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "it depends"]}},
    )
    assert r.choices[0].message.content in ("yes", "no", "it depends")


def test_a_free_form_grammar_is_enforced_and_one_that_does_not_read_is_a_400(client: openai.OpenAI, model: str) -> None:
    gram = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{3,20} "."'
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is the sea blue?"}],
        max_tokens=30,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": gram}},
    )
    assert re.fullmatch(r"(yes|no) because [a-z ]{3,20}\.", r.choices[0].message.content or "")
    with pytest.raises(openai.BadRequestError) as e:  # a rule used, never defined: the compiler would not read it
        client.completions.create(
            model=model, prompt="x", max_tokens=4, extra_body={"guided_grammar": 'root ::= "a" nowhere'}
        )
    assert e.value.param == "guided_grammar"
    # ... and the engine serves on: nothing of it reached the pipeline.
    assert client.completions.create(model=model, prompt="x", max_tokens=4).choices[0].finish_reason in (
        "stop",
        "length",
    )


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_it(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model,
            messages=ASK,
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
        )
    assert e.value.param is not None and e.value.param.startswith("response_format")
    # ... and the engine serves on: nothing of it reached the pipeline.
    assert client.chat.completions.create(model=model, messages=ASK, max_tokens=4).choices[0].message.content


def _call_of(r: openai.types.chat.ChatCompletion) -> tuple[str, dict[str, object]]:
    calls = r.choices[0].message.tool_calls
    assert calls, r.choices[0].message
    return calls[0].function.name, json.loads(calls[0].function.arguments)


def test_a_named_tool_call_validates_against_its_parameters_and_takes_a_follow_up(
    client: openai.OpenAI, model: str
) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=model,
        messages=WEATHER_ASK,
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice=choice,
        max_tokens=40,
        temperature=0,
    )  # type: ignore[arg-type]
    name, args = _call_of(r)
    assert name == "get_weather"
    jsonschema_rs.validate(WEATHER["function"]["parameters"], args)  # type: ignore[index]
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    follow = client.chat.completions.create(
        model=model,
        tools=[WEATHER],
        max_tokens=24,
        temperature=0,
        messages=[  # type: ignore[list-item]
            *WEATHER_ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
        ],
    )
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls


def test_a_streamed_named_tool_call_adds_up_to_the_same_call(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(
        model=model,
        messages=WEATHER_ASK,
        tools=[WEATHER],
        max_tokens=40,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    name, args = "", ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):  # type: ignore[call-overload]
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name += call.function.name or "" if call.function else ""
            args += call.function.arguments or "" if call.function else ""
    assert (name, json.loads(args)) == _call_of(whole)


def test_required_gives_a_call_and_none_gives_none(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=WEATHER_ASK,
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    name, _ = _call_of(r)
    assert name in ("get_weather", "now") and r.choices[0].finish_reason == "tool_calls"
    r = client.chat.completions.create(
        model=model,
        messages=WEATHER_ASK,
        tools=[WEATHER],
        tool_choice="none",  # type: ignore[list-item]
        max_tokens=20,
        temperature=0,
    )
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content


# A template that renders tools itself, as Qwen's and Hermes' do (SmolLM2's does not): the
# default GGUF registered under a second name with it (vLLM's --chat-template).
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. Their signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_renders_tools_shows_them_itself(cluster: LocalCluster, client: openai.OpenAI) -> None:
    """The tools and a past call go to the model's own template (in OpenAI's shape, arguments
    as objects), not into a prompt of Tessera's: the request's prompt is exactly the library's
    rendering of that template. A template that does not render is a 400 at registration."""
    import openvino_genai as ov_genai

    admin = cluster.admin_headers
    bad = httpx.post(
        f"{cluster.base_url}/admin/models",
        headers=admin,
        timeout=600,
        json={"name": "bad-template", "source": str(default_model_path()), "chat_template": "{% for %}"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template", bad.text
    r = httpx.post(
        f"{cluster.base_url}/admin/models",
        headers=admin,
        timeout=600,
        json={"name": "tool-template", "source": str(default_model_path()), "chat_template": TOOL_TEMPLATE},
    )
    assert r.status_code == 201, r.text
    try:
        tok = ov_genai.Tokenizer(r.json()["artifact"]["path"])
        shown = [WEATHER]
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
        }
        turns = [
            WEATHER_ASK,
            [
                *WEATHER_ASK,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
            ],
        ]
        for messages in turns:
            answer = client.chat.completions.create(
                model="tool-template",
                messages=messages,
                tools=shown,
                max_tokens=8,
                temperature=0,  # type: ignore[arg-type]
            )
            native = [
                {
                    **m,
                    "content": m.get("content") or "",
                    **(
                        {
                            "tool_calls": [
                                {
                                    **c,
                                    "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])},
                                }
                                for c in m["tool_calls"]
                            ]
                        }
                        if m.get("tool_calls")
                        else {}
                    ),
                }
                for m in messages
            ]
            text = tok.apply_chat_template(native, add_generation_prompt=True, chat_template=TOOL_TEMPLATE, tools=shown)
            assert "<tools>" in text and "get_weather" in text
            assert answer.usage is not None
            assert answer.usage.prompt_tokens == len(tok.encode(text).input_ids.data[0])
        # `required` is still enforced: a call that validates, whatever the template says.
        forced = client.chat.completions.create(
            model="tool-template",
            messages=WEATHER_ASK,
            tools=shown,
            tool_choice="required",
            max_tokens=60,
            temperature=0,  # type: ignore[arg-type]
        )
        assert forced.choices[0].finish_reason == "tool_calls"
        name, args = _call_of(forced)
        assert name == "get_weather"
        jsonschema_rs.validate(WEATHER["function"]["parameters"], args)
    finally:
        httpx.delete(f"{cluster.base_url}/admin/models/tool-template", headers=admin, timeout=30)
