"""The compile key: jobs that differ only in sizes share one compile; a structural change does not."""

from __future__ import annotations

import dataclasses

import calc
from calc.estimate.core import StructureKey, _structure_key, compiled_for
from tests.specs import tiny_llama


def test_sizes_do_not_change_the_key() -> None:
    a = _structure_key(tiny_llama(), calc.Training(micro_batch=1, seq_len=8))
    b = _structure_key(tiny_llama(), calc.Training(micro_batch=4, seq_len=64))
    assert isinstance(a, StructureKey)
    assert a == b and hash(a) == hash(b)


def test_structure_changes_the_key_in_the_named_field() -> None:
    a = _structure_key(tiny_llama(), calc.Training(micro_batch=1, seq_len=8))
    b = _structure_key(tiny_llama(qkv_bias=True), calc.Training(micro_batch=1, seq_len=8))
    changed = [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
    assert changed == ["model_fields"]
    fields_a, fields_b = dict(a.model_fields), dict(b.model_fields)
    assert [n for n in fields_a if fields_a[n] != fields_b[n]] == ["qkv_bias"]


def test_equal_keys_share_one_compile() -> None:
    model = tiny_llama()
    c1, k1 = compiled_for(model, calc.Training(micro_batch=1, seq_len=8), "cuda")
    c2, k2 = compiled_for(model, calc.Training(micro_batch=2, seq_len=16), "cuda")
    assert k1 == k2 and c1 is c2
