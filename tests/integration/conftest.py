"""Tests that start real processes or servers (a nats-server, spawned workers, a child
interpreter): marked `integration`, so `make unit` (`-m "not e2e and not integration"`) stays the
fast in-process tests and `make test` runs these too. They need no fixture of tests/unit/."""

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
