"""An idle stop as the scheduler's view takes it: the instance gone at once, and what its
node holds resident after the stop with it, before any heartbeat (those sent before the stop
are ignored: a test that read the view then found the model neither served nor resident)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from policy.scheduling import InstanceView, NodeView
from services.scheduler.service import SchedulerService
from services.scheduler.settings import SchedulerSettings
from shared.bus import encode
from shared.messages import InstanceStopped, NodeStatus


async def test_a_stopped_instance_leaves_the_view_with_its_weights_resident_there() -> None:
    scheduler = SchedulerService(SchedulerSettings(), None, None)  # type: ignore[arg-type]
    before = time.time()
    scheduler.nodes["n0"] = NodeView(
        node_id="n0",
        seen_at=before,
        instances={"m": InstanceView(model="m", active=0, last_used=before, loaded_at=before)},
    )
    scheduler._stopped(InstanceStopped(node_id="n0", model="m", stopped=True, resident=("art-m", "art-x")))
    view = scheduler.nodes["n0"]
    assert "m" not in view.instances and view.resident == {"art-m", "art-x"}

    # A heartbeat sent before the stop (the model still served, nothing resident) is ignored.
    stale = NodeStatus(node_id="n0", sent_at=before, instances=(), starting=(), resident=())
    await scheduler.on_heartbeat(SimpleNamespace(data=encode(stale)))  # type: ignore[arg-type]
    assert scheduler.nodes["n0"].resident == {"art-m", "art-x"}

    # A stop answered without the node's holdings (an older engine) leaves the view's as they were.
    scheduler._stopped(InstanceStopped(node_id="n0", model="gone", stopped=False, reason="not loaded"))
    assert scheduler.nodes["n0"].resident == {"art-m", "art-x"}
