"""The torch engine (GPU nodes, and the host in tests): transformers' model code over weights held
in the tensor arena (`cuda_ext`), in pre-warmed workers (`process.py`)."""
