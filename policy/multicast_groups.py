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


@dataclass(frozen=True)
class Joined:
    group: int
    """The group's number (its opener closes it by this number)."""
    opened: bool
    """This scale-out opened it: its caller sends the group's plan at `due`."""


@dataclass
class _Group:
    model: str
    opened_at: float
    targets: list[str]


@dataclass
class Groups:
    window_s: float
    _groups: dict[int, _Group] = field(default_factory=dict)
    _open: dict[str, int] = field(default_factory=dict)
    """Per model, the group that scale-outs of it still join."""
    _next: int = 0

    def join(self, model: str, node: str, now: float) -> Joined:
        """A scale-out of `model` to `node` begins: it joins the model's group opened within
        the window, else opens one (a group past its window takes no one, even before its
        opener has closed it)."""
        number = self._open.get(model)
        if number is not None and now - self._groups[number].opened_at <= self.window_s:
            group = self._groups[number]
            if node not in group.targets:
                group.targets.append(node)
            return Joined(number, False)
        number, self._next = self._next, self._next + 1
        self._groups[number] = _Group(model, now, [node])
        self._open[model] = number
        return Joined(number, True)

    def due(self, group: int) -> float:
        """When the group closes (its opener waits until then)."""
        return self._groups[group].opened_at + self.window_s

    def close(self, group: int) -> list[str]:
        """The group's targets, in the order they joined; none join it after this."""
        closed = self._groups.pop(group, None)
        if closed is None:
            return []
        if self._open.get(closed.model) == group:
            del self._open[closed.model]
        return closed.targets
