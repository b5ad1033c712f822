"""Peer baselines for the cold-start benchmark, each run in a fresh Python process.

    python -m bench.peers llamacpp <model.gguf>
    python -m bench.peers openvino <model.gguf>

prints one JSON line on stdout. Times are taken inside the process with `time.perf_counter()`
from just before the runtime's import, so Python's own start-up is not counted (Tessera's
engine has its runtime imported long before a request arrives, so the comparison is generous
to the peers, not to Tessera).

- llamacpp: `import llama_cpp` → `Llama(...)` → first streamed token of a chat completion;
  then decode speed of a 128-token greedy generation (end-of-sequence ignored).
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

THREADS = 2
PROMPT = "Write a short poem about the sea."
COLD_MAX_TOKENS = 16
DECODE_TOKENS = 128
WARM_RUNS = 5


def llamacpp(gguf: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    import llama_cpp
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    t1 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=gguf, n_threads=THREADS, n_threads_batch=THREADS, n_ctx=2048,
                          verbose=False)
    t2 = time.perf_counter()
    first: float | None = None
    text = ""
    stream = llm.create_chat_completion(
        messages=[{"role": "user", "content": PROMPT}],
        stream=True, max_tokens=COLD_MAX_TOKENS, temperature=0.0,
    )
    for chunk in stream:
        content = chunk["choices"][0]["delta"].get("content")  # type: ignore[index, union-attr]
        if content:
            if first is None:
                first = time.perf_counter()
            text += content
    if first is None:
        raise RuntimeError("llama.cpp streamed no content")

    # Decode: the chat prompt rendered with the GGUF's own template, then exactly DECODE_TOKENS
    # greedy tokens from the low-level generator (it does not stop at end-of-sequence itself).
    template = llm.metadata.get("tokenizer.chat_template")
    if template:
        eos = llm.detokenize([llm.token_eos()], special=True).decode(errors="replace")
        bos = llm.detokenize([llm.token_bos()], special=True).decode(errors="replace")
        prompt = Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos)(
            messages=[{"role": "user", "content": PROMPT}]
        ).prompt
    else:
        prompt = PROMPT
    tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    stamps: list[float] = []
    for _ in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) >= DECODE_TOKENS:
            break
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return {
        "which": "llamacpp",
        "version": llama_cpp.__version__,
        "cold_ttft_s": first - t0,
        "phases": {"import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": first - t2},
        "decode_tok_s": decode,
        "decode_tokens": len(stamps),
        "sample": text,
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
