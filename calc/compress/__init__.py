"""Compression in the replay: quantized weights, LoRA/QLoRA, pruning, distillation.

- ``quant``, ``kv_quant``: weight-only and KV-cache quantization.
- ``lora``: frozen base with low-rank adapters.
- ``prune_replay``: ``torch.nn.utils.prune`` in the step; ``distill``: the teacher and the KD loss.
- ``sparse``: what CSR, COO or 2:4 storage of pruned weights takes (`storage_verdict`).
- ``structured``: the smaller dense model structured pruning leaves (`pruned_spec`).
"""
