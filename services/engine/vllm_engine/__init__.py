"""vLLM behind the worker loop, for nodes whose `engine_backend` is `vllm` (`batch.py`); vLLM is
imported only in its workers (`process.py`)."""
