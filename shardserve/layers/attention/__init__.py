"""Attention over the paged KV cache, as backends behind one interface (backend.py): each builds
its own per-step metadata and runs its own forward. `torch_backend` is the reference path (any
device), `cpu_backend` the native CPU kernels; the model never picks one (the loader does)."""
