"""vLLM behind the engine's worker protocol: a node whose `engine_backend` is `vllm` serves its
models with vLLM's engine (`batch.py`), in workers spawned and driven as the torch engine's are
(`worker_loop.py`, through `worker.VllmBinding`). The package imports vLLM only in those
workers (`process.py`)."""
