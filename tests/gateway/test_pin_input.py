"""Keep warm's admin bodies (issue 35) validated at the edge, as test_strict_input's: a pin or a
registration with an instance count or priority out of range, of the wrong type or misspelt is
a 400 naming the parameter, refused before anything reads the registry."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.test_strict_input import _error, _raw, http  # noqa: F401  (its app, no bus)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"min_instances": 0}', "min_instances"),
        ('{"min_instances": -1}', "min_instances"),
        ('{"min_instances": "2"}', "min_instances"),
        ('{"min_instances": 1.5}', "min_instances"),
        ('{"priority": "high"}', "priority"),
        ('{"priority": 1e12}', "priority"),
        ('{"instances": 2}', "instances"),
    ],
)
async def test_a_pin_out_of_range_or_misspelt_is_a_400_naming_it(
    http: httpx.AsyncClient,  # noqa: F811
    body: str,
    param: str,
) -> None:
    error = _error(await http.post("/admin/models/m/pin", **_raw(body)))  # type: ignore[arg-type]
    assert error["param"] == param


@pytest.mark.parametrize(("field", "value"), [("min_instances", "-1"), ("priority", '"9"'), ("min_instances", "1e9")])
async def test_a_registration_with_a_bad_pin_is_a_400_naming_it(
    http: httpx.AsyncClient,  # noqa: F811
    field: str,
    value: str,
) -> None:
    body = f'{{"name": "m", "source": "/x.gguf", "{field}": {value}}}'
    error = _error(await http.post("/admin/models", **_raw(body)))  # type: ignore[arg-type]
    assert error["param"] == field
