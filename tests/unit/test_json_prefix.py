"""The test helper that tells a cut-off JSON object from text that is no JSON at all."""

from __future__ import annotations

import pytest

from tests.helpers.json_prefix import is_object_prefix


@pytest.mark.parametrize(
    "text",
    ["{", '{"a', '{"a":', '{"a": 1.', '{"a": tr', '{"a": [1, {"b": "x\\', '{"a": -', '{"a": [1,', '{"a": "b"}'],
)
def test_a_whole_or_cut_off_object_is_a_prefix(text: str) -> None:
    assert is_object_prefix(text)


@pytest.mark.parametrize("text", ["", "hello", "[1", '{"a" 1', '{"a": 1}}', '{"a": x', "{,"])
def test_anything_else_is_not(text: str) -> None:
    assert not is_object_prefix(text)
