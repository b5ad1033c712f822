"""The gateway's tokenizer calls run one at a time on one thread (services/gateway/tokenizers.py):
openvino_genai deadlocked with two threads in `Tokenizer.encode` at once."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from services.gateway.tokenizers import Tokenizers


class FakeTokenizer:
    """Stands in for openvino_genai.Tokenizer: records the threads and overlap of its calls."""

    def __init__(self, shared: dict[str, object]) -> None:
        self.shared = shared

    def encode(self, text: str) -> SimpleNamespace:
        s = self.shared
        with s["lock"]:  # type: ignore[attr-defined]
            s["inside"] = int(s["inside"]) + 1  # type: ignore[call-overload]
            s["most"] = max(int(s["most"]), int(s["inside"]))  # type: ignore[call-overload]
            s["threads"].add(threading.current_thread().name)  # type: ignore[attr-defined]
        time.sleep(0.002)  # sync-ok: an encode's own time, during which another call could overlap
        with s["lock"]:  # type: ignore[attr-defined]
            s["inside"] = int(s["inside"]) - 1  # type: ignore[call-overload]
        return SimpleNamespace(input_ids=SimpleNamespace(data=[[len(text), 7]]))


async def test_concurrent_encodes_of_two_models_never_overlap() -> None:
    shared: dict[str, object] = {"lock": threading.Lock(), "inside": 0, "most": 0, "threads": set()}
    toks = Tokenizers()
    a, b = FakeTokenizer(shared), FakeTokenizer(shared)
    texts = [f"text {i}" * (i + 1) for i in range(20)]
    ids = await asyncio.gather(*(toks.encode(a if i % 2 else b, t) for i, t in enumerate(texts)))  # type: ignore[arg-type]
    assert ids == [(len(t), 7) for t in texts]
    assert shared["most"] == 1
    assert len(shared["threads"]) == 1  # type: ignore[arg-type]
