"""The `hf` implementation: a Hugging Face transformers model built from a (scaled) `ModelSpec`.

Built from a config with ``AutoModelForCausalLM.from_config`` (``HF_HUB_OFFLINE=1``: nothing is
downloaded). ``transformers`` is an optional extra: `available` says whether it imports.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from calc.config.hf_config import hf_config_dict
from calc.derive.record import CHECKPOINT_DTYPE_KEYS, class_supports_sdpa

if TYPE_CHECKING:
    import torch

    from calc.config.model_spec import ModelSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def available() -> bool:
    """Whether ``transformers`` can be imported."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def hf_config(spec: ModelSpec) -> Any:
    """A ``transformers`` config object for ``spec``."""
    import transformers

    fields = hf_config_dict(spec)
    for key in CHECKPOINT_DTYPE_KEYS:  # from_config would build in the checkpoint's dtype
        fields.pop(key, None)
    model_type = fields.pop("model_type")
    return transformers.AutoConfig.for_model(model_type, **fields)


def build_hf(
    spec: ModelSpec, attention: str = "sdpa", device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """``AutoModelForCausalLM`` for ``spec`` with ``attn_implementation`` ``sdpa`` or ``eager``,
    initialised on ``device`` in training mode (seed the RNG before calling for fixed weights)."""
    import torch
    import transformers

    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention={attention!r} must be 'sdpa' or 'eager'")
    config = hf_config(spec)
    if attention == "sdpa" and not class_supports_sdpa(config):
        attention = "eager"  # what from_config builds when none is asked (Gemma-2)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    return model.train()


def build_hf_on_meta(spec: ModelSpec, attention: str = "sdpa") -> torch.nn.Module:
    """The same model on the ``meta`` device: shapes only, no memory (for full-size cards)."""
    return build_hf(spec, attention, device="meta")


def hf_loss(
    model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean next-token loss with ``labels`` (a separate tensor, as a data collator makes it;
    default ``ids``); transformers' ``ForCausalLMLoss`` shifts them."""
    return model(input_ids=ids, labels=ids if labels is None else labels).loss
