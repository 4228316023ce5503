"""``calc.estimate``: replay once per structure, compile once, evaluate in microseconds.

- ``core``: `estimate`, the compile cache and its key.
- ``ranks``: the most-loaded rank of a parallel job.
- ``result``: `Estimate`, the peak, its phase and the breakdown tree.
"""
