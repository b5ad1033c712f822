"""One request sent with the official client on a thread of its own, and how it ended: a test
acts on the cluster (preempts, cuts) while the request runs."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import openai


@dataclass
class Outcome:
    """How one request ended, as the official client saw it."""

    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    status: int | None = None
    """Of an HTTP error (a stream's error event has none: its 200 is long sent)."""
    retry_after: str | None = None
    error: dict[str, Any] | None = None
    failure: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    """Set: a stream's client leaves at its next chunk."""

    def ended(self, timeout_s: float) -> Outcome:
        assert self.done.wait(timeout_s), f"the request did not end within {timeout_s}s"
        assert not self.failure, self.failure
        return self


def complete_in_background(client: openai.OpenAI, stream: bool, **body: Any) -> Outcome:
    out = Outcome()

    def run() -> None:
        try:
            if stream:
                stream_ = client.completions.create(stream=True, stream_options={"include_usage": True}, **body)
                for chunk in stream_:
                    if out.stop.is_set():  # the client leaves: the gateway cancels the request
                        stream_.close()
                        break
                    if chunk.choices:
                        out.text += chunk.choices[0].text
                        out.finish_reason = chunk.choices[0].finish_reason or out.finish_reason
                    if chunk.usage:
                        out.completion_tokens = chunk.usage.completion_tokens
            else:
                r = client.completions.create(**body)
                out.text, out.finish_reason = r.choices[0].text, r.choices[0].finish_reason
                out.completion_tokens = r.usage.completion_tokens if r.usage else None
        except openai.APIStatusError as e:
            out.status, out.retry_after = e.status_code, e.response.headers.get("retry-after")
            out.error = e.body if isinstance(e.body, dict) else {"unreadable": e.body}
        except openai.APIError as e:  # a stream's error event
            out.error = e.body if isinstance(e.body, dict) else {"unreadable": e.body}
        except Exception as e:
            out.failure = f"{type(e).__name__}: {e}"
        finally:
            out.done.set()

    threading.Thread(target=run, daemon=True).start()
    return out
