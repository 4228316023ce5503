"""Memory outside PyTorch's allocator (`calc.data.outside`): each term against its source's
figure, written out here from the source, and the verdict's charge per layout."""

from __future__ import annotations

import pytest

import calc
from calc.data import outside
from calc.data.gpus import get_gpu

MIB = 2**20


def test_nccl_default_buffers_follow_nccl_init_cc() -> None:
    # NCCL src/init.cc: DEFAULT_BUFFSIZE 1 << 22; DEFAULT_LL_BUFFSIZE = 8 lines x 512 threads x
    # 8 steps x 16 B = 524,288; DEFAULT_LL128_BUFFSIZE = 120 x 640 x 8 x 8 B = 4,915,200
    per_connection = 4_194_304 + 524_288 + 4_915_200  # 9,633,792 B
    assert outside.nccl_buffer_bytes(1, 1) == per_connection
    # a ring: 2 connections per channel; 32 channels -> 616,562,688 B = 588 MiB
    assert outside.nccl_buffer_bytes(32) == 616_562_688 == 588 * MIB
    # the source's buffers at 32 channels lie inside the measured range per communicator
    term = outside.nccl_term(1)
    assert term.low_bytes <= outside.nccl_buffer_bytes(32) <= term.high_bytes
    with pytest.raises(ValueError, match="channels"):
        outside.nccl_buffer_bytes(0)


def test_context_range_follows_the_published_measurements() -> None:
    lazy, eager = outside.context_term("lazy"), outside.context_term("eager")
    # pytorch/pytorch PR #86509: 287,047,680 B lazy vs 666,632,192 B eager after init;
    # issue #107667: ">1000MB" with every kernel loaded
    assert (lazy.low_bytes, lazy.high_bytes) == (287_047_680, 1000 * MIB)
    assert (eager.low_bytes, eager.high_bytes) == (666_632_192, 1000 * MIB)
    with pytest.raises(ValueError, match="loading"):
        outside.context_term("fast")  # type: ignore[arg-type]


def test_driver_term_is_the_catalog_readings_difference_or_a_stated_range() -> None:
    # T4: nvidia-smi 15360 MiB, PyTorch "total capacity of 14.75 GiB" = 15104 MiB: 256 MiB
    t4 = get_gpu("t4-16gb")
    term = outside.driver_term(t4.total_bytes, t4.cuda_total_bytes)
    assert term.low_bytes == term.high_bytes == 256 * MIB
    assert term.basis == "published reading"
    unknown = outside.driver_term(t4.total_bytes, None)
    assert (unknown.low_bytes, unknown.basis) == (0, "no source")


@pytest.mark.parametrize(
    ("parallel", "count"),
    [
        (None, 0),
        (calc.Parallelism(dp=8), 1),  # the data-parallel group (DDP, ZeRO, FSDP2 alike)
        (calc.Parallelism(dp=2, tp=2), 2),  # one group per dimension
        (calc.Parallelism(pp=2), 1),  # one send/recv pair
        (calc.Parallelism(pp=4, dp=2), 3),  # a middle stage: two neighbours, plus dp
    ],
)
def test_communicators_per_layout(parallel: calc.Parallelism | None, count: int) -> None:
    assert outside.communicators(parallel) == count


def test_usable_for_a_layout_subtracts_its_communicators_upper_end() -> None:
    h100 = get_gpu("h100-80gb")
    # two communicators (dp and tp) at 1.6 GB (1638 MiB) each, NVIDIA/nccl issue #864
    two = calc.Parallelism(dp=2, tp=2)
    assert h100.usable_bytes - h100.usable_for(two) == 2 * 1638 * MIB
    assert h100.usable_for(None) == h100.usable_bytes
    terms = {t.key: t for t in h100.outside(two).terms}
    assert set(terms) == {"driver_reserved", "cuda_context", "nccl"}
    assert h100.outside().high_bytes == h100.reserved_bytes
    assert all(t.source for t in terms.values())  # every term cites its source


def test_a_term_validates_its_range_and_basis() -> None:
    with pytest.raises(ValueError, match="low_bytes"):
        outside.OutsideTerm("x", 2, 1, "source", "s")
    with pytest.raises(ValueError, match="basis"):
        outside.OutsideTerm("x", 1, 2, "hearsay", "s")  # type: ignore[arg-type]
