"""``Training(dropout=p)`` on a derived architecture: the config with every dropout site at
``p``.

calc's ``dropout`` is "every dropout site" (`calc.config.jobs.Training`); transformers' models
read their sites from config keys whose names vary by family (``attention_dropout`` in most,
``resid_pdrop``/``embd_pdrop`` in Phi-3, ``residual_dropout``/``embedding_dropout`` in
Starcoder2, ``hidden_dropout`` in others). `dropout_config` sets every numeric top-level key
named so (ending in ``dropout``, ``pdrop``, ``dropout_prob`` or ``dropout_rate``), those the
config leaves out included (their defaults in the family's config class, which transformers
fills in); a site the family hard-codes, or a key it does not read, changes nothing, as in a
run given the same config. verify's derived cases build their models from the same config.
torch and transformers are imported only inside `dropout_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DROPOUT_SUFFIXES = ("dropout", "pdrop", "dropout_prob", "dropout_rate")
"""Endings of the config keys that hold a dropout probability."""


def dropout_keys(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys of ``config`` that hold a dropout probability (numbers, not booleans)."""
    return tuple(
        key
        for key, value in config.items()
        if key.endswith(DROPOUT_SUFFIXES)
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    )


def dropout_config(config: Mapping[str, Any], p: float | None) -> dict[str, Any]:
    """``config`` with every dropout key at ``p``: its own (`dropout_keys`) and those of its
    ``model_type``'s config class (``AutoConfig.for_model``); unchanged for ``None``."""
    out = dict(config)
    if p is None:
        return out
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(str(config["model_type"])).to_dict()
    out.update({key: p for key in (*dropout_keys(defaults), *dropout_keys(config))})
    return out
