"""Cards against transformers' own modules, built on the meta device (no memory): every card's
published count equals the meta-device count of ``AutoModelForCausalLM.from_config``, and for
the architectures ``ModelSpec`` reads, so do our count and our tensor list."""

from __future__ import annotations

import functools
import re

import pytest

from calc.data.cards import (
    list_cards,
    load_card,
    load_card_config,
    published_params,
    published_params_precision,
)
from tests.specs import modelled_cards

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_PREFIX = re.compile(r"^(model|transformer)\.")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")
_MODELLED = modelled_cards()


@functools.cache
def _build_on_meta(card_id: str):
    config = dict(load_card_config(card_id))
    model_type = config.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf_config)


def _hf_tensors(model) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, prefix stripped, layer 0 kept and written as ``*``."""
    out = []
    for name, p in model.named_parameters():
        short = _PREFIX.sub("", name)
        match = _LAYER_INDEX.search(short)
        if match and match.group(1) != "0":
            continue
        out.append((_LAYER_INDEX.sub(".*.", short, count=1), tuple(p.shape)))
    return out


@pytest.mark.parametrize("card_id", list_cards())
def test_published_count_equals_meta_count(card_id: str) -> None:
    # The expected value is the card's published figure (published.json cites it), compared at
    # the precision it was published: exact where the publisher gives the exact count (e.g. a
    # safetensors index total), else rounded to n_params_precision (e.g. "46.7B" -> 10**8).
    counted = sum(p.numel() for p in _build_on_meta(card_id).parameters())
    unit = published_params_precision(card_id)
    assert round(counted / unit) * unit == published_params(card_id)


@pytest.mark.parametrize("card_id", _MODELLED)
def test_meta_model_matches_param_tensors(card_id: str) -> None:
    spec = load_card(card_id)
    model = _build_on_meta(card_id)
    assert sum(p.numel() for p in model.parameters()) == spec.n_params
    assert model.num_parameters() == spec.n_params
    ours = [(t.name, tuple(t.shape)) for t in spec.param_tensors()]
    assert _hf_tensors(model) == ours
