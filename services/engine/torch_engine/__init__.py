"""The torch engine: transformers model code over weights held in the tensor arena (`cuda_ext`).

For GPU nodes (and, for tests, the host): a pre-warmed worker binds a model by building its
skeleton on the meta device and pointing every parameter at the arena's views, so a start
copies no weight that is already resident (Tangram §3.1) and copies the rest in access order
behind the first forward pass (TIDAL §5).
"""
