"""The data files ``calc`` reads: model cards, the GPU catalog, the verify report, the planner's cache.

The only package of ``calc`` that touches files.
- ``cards``: model cards (``model_cards/<id>/``), file paths, the planner's on-disk cache.
- ``gpus``: the GPU catalog (``hardware/gpus.json``).
- ``hub``: a model's ``config.json`` by Hugging Face id (``from_pretrained``), through
  ``huggingface_hub``'s cache.
"""
