"""The calculator against every GPU measurement recorded under verify/measurements/.

Expected values here are measurements (``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` on a real GPU), never numbers the calculator produced; the checking
logic is `verify.gpu_check.check_file` (exercised without a GPU in tests/verify/test_gpu_check.py
on synthetic files made in a temporary folder). With no file recorded yet the test is skipped,
and says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from verify.gpu_check import check_file

MEASUREMENTS = Path(__file__).resolve().parents[2] / "verify" / "measurements"
FILES = sorted(MEASUREMENTS.glob("*.json"))  # superseded/ holds runs kept as evidence only


@pytest.mark.skipif(not FILES, reason="no GPU measurement recorded yet (verify/measurements/)")
@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES] or None)
def test_calc_within_tolerance_of_every_recorded_gpu_file(path: Path) -> None:
    assert check_file(path) == []
