"""Peer baselines for the cold-start benchmark, each run in a fresh Python process.

    python -m bench.peers llamacpp <model.gguf>
    python -m bench.peers openvino <model.gguf>

prints one JSON line on stdout. Times are taken with `time.perf_counter()` from just before
the runtime starts (the server process is spawned, or the runtime imported), so Python's own
start-up is not counted (Tessera's engine has its runtime imported long before a request
arrives, so the comparison is generous to the peers, not to Tessera).

- llamacpp: spawn llama.cpp's `llama-server` (built by `bench/llama_server.py`) → `/health`
  ready → first streamed token of a chat completion; then decode speed of a 128-token greedy
  generation (end-of-sequence ignored), through the same server.
- openvino: `import openvino_genai` → `LLMPipeline(gguf)` (which converts the GGUF on every
  load: the "naive" way to serve a GGUF with OpenVINO) → first streamed token; then, in the
  same process, warm TTFT (median of 5) and decode speed of a 128-token generation.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import httpx

from bench.common import ChatStream, chat_body
from bench.llama_server import LLAMA_CPP_PYTHON_VERSION, LlamaServer

THREADS = 2
PROMPT = "Write a short poem about the sea."
COLD_MAX_TOKENS = 16
DECODE_TOKENS = 128
WARM_RUNS = 5
SERVER_READY_TIMEOUT_S = 120.0


def stream_timed(http: httpx.Client, body: dict[str, Any]) -> ChatStream:
    """One streamed chat completion, every content chunk's arrival stamped."""
    chat = ChatStream()
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"llama-server answered {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not chat.feed(line):
                break
    problem = chat.problem()
    if problem is not None:
        raise RuntimeError(f"llama-server: {problem}")
    return chat


def llamacpp(gguf: str) -> dict[str, Any]:
    """A cold start of llama.cpp as its users run it: a fresh `llama-server` process (built from
    source by bench/llama_server.py) on the GGUF, then the first streamed chat token.

    Phases (the keys bench/coldstart.py reads): `import_s` = spawning the process, `load_s` =
    spawned -> `/health` answers 200 (model load, warm-up, listening), `first_token_s` = ready
    -> first streamed content (request, prefill, first decode)."""
    # One slot of 2,048 tokens, as llama-cpp-python's `Llama(n_ctx=2048)` had; --jinja: the
    # GGUF's own chat template, as Tessera and OpenVINO apply it.
    server = LlamaServer(gguf, threads=THREADS, ctx=2048, parallel=1, extra=["--jinja"])
    # The client exists before the clock starts: its making is no part of llama.cpp's start.
    http = httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(120.0))
    try:
        t0 = time.perf_counter()
        server.start()
        t1 = time.perf_counter()
        server.wait_ready(SERVER_READY_TIMEOUT_S, http)
        t2 = time.perf_counter()
        cold = stream_timed(http, chat_body("gguf", PROMPT, COLD_MAX_TOKENS))
        first = cold.arrivals[0]
        # Decode: exactly DECODE_TOKENS greedy tokens, end-of-sequence ignored.
        dec = stream_timed(http, chat_body("gguf", PROMPT, DECODE_TOKENS, ignore_eos=True))
    finally:
        http.close()
        server.stop()
    n = int((dec.usage or {}).get("completion_tokens", len(dec.arrivals)))
    decode = (n - 1) / (dec.arrivals[-1] - dec.arrivals[0])
    return {
        "which": "llamacpp",
        "version": LLAMA_CPP_PYTHON_VERSION,
        "binary": str(server.binary),
        "cold_ttft_s": first - t0,
        "phases": {"import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": first - t2},
        "decode_tok_s": decode,
        "decode_tokens": n,
        "sample": "".join(cold.chunks),
    }


def openvino(gguf: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    import openvino_genai as ov_genai

    t1 = time.perf_counter()
    pipe = ov_genai.LLMPipeline(gguf, "CPU", INFERENCE_NUM_THREADS=THREADS)
    t2 = time.perf_counter()
    tok = pipe.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)

    def config(max_new_tokens: int, ignore_eos: bool = False) -> Any:
        cfg = pipe.get_generation_config()
        cfg.apply_chat_template = False
        cfg.max_new_tokens = max_new_tokens
        cfg.do_sample = False
        cfg.ignore_eos = ignore_eos
        return cfg

    def ttft(start: float) -> tuple[float, str]:
        """Generate COLD_MAX_TOKENS; seconds from `start` to the first non-empty text piece."""
        first: list[float] = []
        pieces: list[str] = []

        def on_text(piece: str) -> ov_genai.StreamingStatus:
            if piece and not first:
                first.append(time.perf_counter())
            pieces.append(piece)
            return ov_genai.StreamingStatus.RUNNING

        pipe.generate(prompt, config(COLD_MAX_TOKENS), on_text)
        if not first:
            raise RuntimeError("OpenVINO streamed no text")
        return first[0] - start, "".join(pieces)

    cold, text = ttft(t0)
    first_token_s = cold - (t2 - t0)

    warm = []
    for _ in range(WARM_RUNS):
        warm.append(ttft(time.perf_counter())[0])

    class Counter(ov_genai.StreamerBase):  # type: ignore[misc]
        """Stamps every token (not text piece), so the count is exact."""

        def __init__(self) -> None:
            super().__init__()
            self.stamps: list[float] = []

        def write(self, token: int | list[int]) -> ov_genai.StreamingStatus:
            now = time.perf_counter()
            self.stamps.extend([now] * (len(token) if isinstance(token, list) else 1))
            return ov_genai.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    counter = Counter()
    pipe.generate(prompt, config(DECODE_TOKENS, ignore_eos=True), counter)
    stamps = counter.stamps
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return {
        "which": "openvino",
        "version": ov_genai.__version__,
        "cold_ttft_s": cold,
        "phases": {"import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": first_token_s},
        "warm_ttft_s": statistics.median(warm),
        "warm_ttft_runs_s": warm,
        "decode_tok_s": decode,
        "decode_tokens": len(stamps),
        "sample": text,
    }


PEERS = {"llamacpp": llamacpp, "openvino": openvino}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in PEERS:
        print(f"usage: python -m bench.peers {{{'|'.join(PEERS)}}} <model.gguf>", file=sys.stderr)
        return 2
    result = PEERS[argv[0]](argv[1])
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
