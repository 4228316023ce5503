"""What a storage on the tape is for: the first element of every live-set key.

The estimate's breakdown files each storage under a tree key chosen by its kind
(`calc.estimate.core`: ``weights/...``, ``gradients/...``, ``activations/...``, ...). A
`StorageKind` is a `StrEnum`, so it compares and hashes equal to its value: code that still
writes ``"weight"`` files the storage under the same key.
"""

from __future__ import annotations

from enum import StrEnum


class StorageKind(StrEnum):
    """The closed set of storage categories the replay allocates."""

    WEIGHT = "weight"
    """A parameter (or the values of a quantized one)."""
    QSCALE = "qscale"
    """A quantized weight's overhead: scales, zero points, absmax, the NF4 code."""
    ADAPTER = "adapter"
    """LoRA's A and B matrices."""
    GRAD = "grad"
    """A parameter's ``.grad`` (or a shard or bucket of gradients)."""
    STATE = "state"
    """Optimizer state (moments, momentum, master weights, the grad scaler's scalars)."""
    INPUT = "input"
    """Token ids and targets, alive before the step starts."""
    BUFFER = "buffer"
    """Module buffers (RoPE tables) and pipeline receive buffers."""
    ACT = "act"
    """An activation or temporary; counted as `SAVED` while an autograd node saves it."""
    SAVED = "saved"
    """An `ACT` storage that an autograd node holds as a saved variable (never allocated as
    such: `calc.replay.tape.Storage.key` reports it)."""
    KV_CACHE = "kv_cache"
    """The inference KV cache (and its quantization scales)."""
    PRUNING = "pruning"
    """``torch.nn.utils.prune``'s masks and materialised weights."""
    TEACHER = "teacher"
    """A distillation teacher's storages."""
