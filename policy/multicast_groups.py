"""Scale-outs that begin together share one multicast plan (FaaScale §4-5).

The scheduler decides a scale-out per request; in a burst, several requests that no running
instance validates each start the model on another node within a few milliseconds of each
other. Sent one plan per node, every new node would read the whole blob from the same
holders, whose uplinks then carry it once per node (the baseline PipeCast beats). So a
scale-out opens a group for its model, and those that begin within `window_s` of it join
that group: when the window closes, one plan covers every target, and each target forwards
blocks to the next while it receives them.

Pure: names and times in, groups out; the scheduler holds the clock and does the sending.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Open:
    opened_at: float
    targets: list[str]


@dataclass
class Groups:
    window_s: float
    _open: dict[str, _Open] = field(default_factory=dict)

    def join(self, model: str, node: str, now: float) -> bool:
        """A scale-out of `model` to `node` begins: True where it opens a group (its caller
        sends the group's plan at `due`), False where it joined the one open."""
        group = self._open.get(model)
        if group is not None and now - group.opened_at <= self.window_s:
            if node not in group.targets:
                group.targets.append(node)
            return False
        self._open[model] = _Open(now, [node])
        return True

    def due(self, model: str) -> float:
        """When the open group of `model` closes (its opener waits until then)."""
        return self._open[model].opened_at + self.window_s

    def close(self, model: str) -> list[str]:
        """The open group's targets, in the order they joined; later scale-outs open another."""
        group = self._open.pop(model, None)
        return group.targets if group is not None else []
