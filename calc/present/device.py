"""What the device shows: the allocated peak, the memory outside PyTorch and the GPU's total side
by side (the verdict's terms), and the caching allocator's reserved memory per setting, each
row saying whether it is modelled from source, from published figures, or measured.

``fits`` everywhere (the CLI, the planner, the app) is ``allocated peak + outside PyTorch <=
total`` with the outside terms at their upper end (`calc.data.outside`; ``GPU.usable_for``);
the allocator replay (`calc.estimate.device_fit`) adds what the allocator reserves above the
peak, for both ``expandable_segments`` settings.
"""

from __future__ import annotations

from collections.abc import Sequence

from calc.config.parallelism import Parallelism
from calc.data.gpus import GPU
from calc.data.outside import Basis
from calc.estimate.device_fit import DeviceFit
from calc.units import GIB

STATUS = {
    "published reading": "published readings",
    "published measurement": "published measurements (a range)",
    "source": "modelled from source",
    "no source": "no source: a stated range",
}
"""How each `calc.data.outside` basis reads in a table."""
Row = dict[str, object]


def _gib(nbytes: int) -> float:
    return round(nbytes / GIB, 3)


def peak_status(device: str) -> str:
    """Where the allocated peak's figure stands: measured on the CPU tracker for
    ``device="cpu"``; on CUDA modelled from PyTorch's source (its CPU-visible terms verified on
    the CPU tracker, its CUDA-only terms not measured on a GPU: the evidence line says which)."""
    if device == "cpu":
        return "verified by measurement (CPU tracker)"
    return "modelled from PyTorch's source; CPU-visible terms verified on the CPU tracker"


def device_rows(peak_bytes: int, gpu: GPU, parallel: Parallelism | None, device: str) -> list[Row]:
    """One row per term of the verdict: the allocated peak, each term outside PyTorch (low and
    high end), their sum at the upper end (what ``nvidia-smi`` would show, less the allocator's
    reserve above the peak), and the GPU's total."""
    rows: list[Row] = [
        {"term": "allocated peak (max_memory_allocated)", "low GiB": _gib(peak_bytes),
         "GiB": _gib(peak_bytes), "basis": peak_status(device), "source": "calc's replay"},
    ]  # fmt: skip
    for t in gpu.outside(parallel).terms:
        rows.append(
            {"term": f"outside PyTorch: {t.key}", "low GiB": _gib(t.low_bytes),
             "GiB": _gib(t.high_bytes), "basis": _status(t.basis), "source": t.source}
        )  # fmt: skip
    charged = gpu.total_bytes - gpu.usable_for(parallel)
    rows.append(
        {"term": "in use (peak + outside PyTorch)", "low GiB": _gib(peak_bytes + charged),
         "GiB": _gib(peak_bytes + charged), "basis": "the sum, upper ends",
         "source": "the verdict compares it with the total"}
    )  # fmt: skip
    rows.append(
        {"term": "device total (nvidia-smi)", "low GiB": _gib(gpu.total_bytes),
         "GiB": _gib(gpu.total_bytes), "basis": "published reading", "source": gpu.source}
    )  # fmt: skip
    return rows


def _status(basis: Basis) -> str:
    return STATUS[basis]


def reserved_rows(fits: Sequence[DeviceFit]) -> list[Row]:
    """One row per allocator setting: allocated, reserved, outside PyTorch, what ``nvidia-smi``
    would show, the total and the verdict (modelled from source; checked on an H200)."""
    return [
        {
            "setting": f.setting,
            "allocated GiB": _gib(f.allocated_bytes),
            "reserved GiB": _gib(f.reserved_bytes),
            "outside PyTorch GiB": _gib(f.outside_bytes),
            "nvidia-smi GiB": _gib(f.shown_bytes),
            "total GiB": _gib(f.total_bytes),
            "fits": f.fits,
        }
        for f in fits
    ]


def markdown_table(rows: Sequence[Row]) -> str:
    """``rows`` (same keys) as a Markdown table: floats with 3 decimals, ``|`` escaped."""
    if not rows:
        return ""
    keys = list(rows[0])

    def cell(v: object) -> str:
        text = f"{v:.3f}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|")

    head = "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys)
    body = ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join([head, *body])
