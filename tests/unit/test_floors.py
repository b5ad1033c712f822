"""The house's floors, as its imports show them: `policy/` (pure policy) and `shared/` (common
code) import nothing of `services/` or `ops/`; a service imports no other service; `ops/` (the
local-cluster runner and the CLI) is imported by no service."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").is_file())


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at any depth (an import inside a function counts too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def top(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth])


def files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


MESSAGE_MODULES = ("shared.messages", "shared.routing_messages", "shared.pipeline_messages", "shared.cache_messages")


@pytest.mark.parametrize("floor", ["policy", "shared"])
def test_the_lower_floors_import_no_service_and_no_operations_code(floor: str) -> None:
    bad = {
        f"{f.relative_to(ROOT)} imports {m}"
        for f in files(floor)
        for m in imports_of(f)
        if top(m, 1) in ("services", "ops")
        or (
            floor == "policy"
            and top(m, 1) == "shared"
            # Message types only: `shared.messages` and the modules split from it.
            and not any(m == t or m.startswith(t + ".") for t in MESSAGE_MODULES)
        )
    }
    assert not bad, sorted(bad)


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_no_other_service_and_no_operations_code(service: str) -> None:
    bad = {
        f"{f.relative_to(ROOT)} imports {m}"
        for f in files(f"services/{service}")
        for m in imports_of(f)
        if (top(m, 1) == "services" and top(m, 2) not in ("services", f"services.{service}")) or top(m, 1) == "ops"
    }
    assert not bad, sorted(bad)


def test_policy_is_pure() -> None:
    """No I/O in the ground floor: no sockets, processes, files, clocks read or event loops."""
    impure = {
        "asyncio",
        "socket",
        "subprocess",
        "os",
        "threading",
        "multiprocessing",
        "nats",
        "redis",
        "httpx",
        "openvino",
        "openvino_genai",
        "numpy",
        "time",
        "pathlib",
    }
    bad = {f"{f.relative_to(ROOT)} imports {m}" for f in files("policy") for m in imports_of(f) if top(m, 1) in impure}
    assert not bad, sorted(bad)
