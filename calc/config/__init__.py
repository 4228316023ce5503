"""What the user asks about, as frozen, validated configs (the lowest layer of ``calc``).

- ``model_spec``: `ModelSpec`, a Hugging Face ``config.json`` read into dimensions and parameter tensors.
- ``jobs``: `Training` and `Inference`, the job of one GPU (or one rank).
- ``parallelism``: `Parallelism`, how a training step is spread over GPUs.
- ``compression``: `LoRA`, `Quant` (and the KV-cache quantization choices).
- ``pruning``, ``distill``: `Pruning` and `Distill`.
"""
