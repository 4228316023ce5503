"""`calc.replay.kinds.StorageKind`: the closed set of storage categories on the tape."""

from __future__ import annotations

import json

import pytest

from calc.replay.kinds import StorageKind
from calc.replay.tape import Tape


def test_a_kind_is_its_string_in_keys_and_json() -> None:
    """Breakdowns and snapshots key dicts by kind: the enum must hash, compare and serialise
    as the plain string the breakdown names were written with."""
    assert {StorageKind.KV_CACHE: 1} == {"kv_cache": 1}
    assert json.dumps({StorageKind.WEIGHT: 2}) == '{"weight": 2}'
    assert f"{StorageKind.SAVED}" == "saved"


def test_a_string_kind_is_filed_as_the_enum_and_a_typo_is_refused() -> None:
    tape = Tape()
    t = tape.new(256, 4, "w", "weight")
    assert t.storage.key[0] is StorageKind.WEIGHT
    with pytest.raises(ValueError, match="wieght"):
        tape.new(256, 4, "w", "wieght")


def test_a_saved_activation_counts_as_saved_until_released() -> None:
    tape = Tape()
    x = tape.new(256, 4, "x")
    assert x.storage.key[0] is StorageKind.ACT
    x.storage.saved = 1
    assert x.storage.key[0] is StorageKind.SAVED
    x.storage.saved = 0
    assert x.storage.key[0] is StorageKind.ACT
