"""The engine's import chain (issue 32): what `python -m services.engine` imports at start, the
longest chain of this repository's modules each importing the next at module level (imports
inside functions and under TYPE_CHECKING run later or never), read from the sources."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "shared", "policy", "cuda_ext", "ops")
MOST_IMPORTS_DEEP = 7


def source(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


@cache
def imports(module: str) -> tuple[str, ...]:
    """The repository's modules `module` imports at module level (a package's too: importing
    `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first)."""
    path = source(module)
    if path is None:
        return ()
    found: list[str] = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    named = {m for m in found if m.split(".")[0] in PACKAGES and source(m) is not None}
    return tuple(sorted(named - {module}))


def longest_chain(module: str, seen: frozenset[str] = frozenset()) -> list[str]:
    chains = [longest_chain(m, seen | {module}) for m in imports(module) if m not in seen | {module}]
    return [module, *max(chains, key=len, default=[])]


def test_the_engine_starts_through_at_most_seven_imports_deep() -> None:
    chain = longest_chain("services.engine.__main__")
    assert len(chain) - 1 <= MOST_IMPORTS_DEEP, " -> ".join(chain)


def test_the_chain_reader_sees_an_import_chain() -> None:
    # The reader finds the service's parts (else the check above would hold vacuously).
    assert "services.engine.service" in imports("services.engine.__main__")
    assert len(longest_chain("services.engine.__main__")) > 3
