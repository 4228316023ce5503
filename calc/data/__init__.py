"""The data files ``calc`` reads: model cards, the GPU catalog, the verify report, the planner's cache.

The only package of ``calc`` that touches files.
- ``cards``: model cards (``model_cards/<id>/``), file paths, the planner's on-disk cache.
- ``gpus``: the GPU catalog (``hardware/gpus.json``).
"""
