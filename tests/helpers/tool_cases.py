"""The tools, schemas and ids the function-calling tests share."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from services.gateway.tools import Tool

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def tool(name: str, parameters: dict[str, Any] | None = None, description: str | None = None) -> Tool:
    return Tool.model_validate(
        {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
    )


TOOLS = [tool("get_weather", WEATHER, "The weather in a city"), tool("now")]


def make_id() -> Callable[[], str]:
    """Ids call_0, call_1, ...: a fresh count for each parse or stream compared."""
    count = itertools.count()
    return lambda: f"call_{next(count)}"


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def resolve(root: Any, ref: str) -> Any:
    """The node a JSON-schema `$ref` ("#/a/b") points at in `root`."""
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        node = node[part]
    return node
