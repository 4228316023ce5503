"""The replay engine: a symbolic tape of what PyTorch allocates and frees, op by op.

- ``tape``: `Tape`, `Tensor`, `Storage`, the autograd engine's backward and the 512-B rounding.
- ``kinds``: `StorageKind`, what a storage is for (weight, grad, state, activation, ...).
- ``ops``: the op library (what each op allocates, saves for backward and frees).
- ``timeline``: from a replayed step to the peak for any number of layers.
"""
