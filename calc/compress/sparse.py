"""What sparse storage of pruned weights takes, and whether it saves anything.

A weight pruned with ``torch.nn.utils.prune`` stays dense (zeros included) until it is stored
otherwise (memory-facts.md §2.10): as CSR or COO (`sparse_bytes`, saving below the density
`break_even_nnz` gives), or, for a 2:4 mask, packed with metadata (`semi_structured_bytes`).
`storage_verdict` weighs them for every pruned weight of a model, allocator-rounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, get_args

from calc.config.model_spec import ModelSpec
from calc.config.pruning import Pruning, pruned_shapes
from calc.replay.tape import round_block

IndexDtype = Literal["int64", "int32"]
INDEX_DTYPES: tuple[str, ...] = get_args(IndexDtype)
INDEX_ITEMSIZE = {"int64": 8, "int32": 4}


def pruned_nnz(numel: int, amount: float) -> int:
    """Non-zeros left in a tensor of ``numel`` elements pruned at ``amount``:
    ``numel - round(amount * numel)`` (``torch/nn/utils/prune.py``,
    ``_compute_nparams_toprune``: Python's ``round``, ties to even)."""
    return numel - round(amount * numel)


def sparse_bytes(
    rows: int, cols: int, nnz: int, fmt: str, value_itemsize: int, index_dtype: str = "int64"
) -> dict[str, int]:
    """Bytes of each tensor of a ``rows x cols`` matrix with ``nnz`` non-zeros stored as
    ``fmt`` (exact, before allocator rounding).

    * ``dense``: ``values`` = rows*cols*itemsize.
    * ``csr`` (``Tensor.to_sparse_csr``): ``values`` nnz*itemsize, ``col_indices`` nnz*idx,
      ``crow_indices`` (rows+1)*idx.
    * ``coo`` (``Tensor.to_sparse``): ``values`` nnz*itemsize, ``indices`` [2, nnz]*idx.

    Index dtype: torch builds int64 indices; a CSR tensor keeps int32 ones when built from
    them (``torch.sparse_csr_tensor(crow.int(), col.int(), ...)``); COO indices are always
    int64 (``torch.sparse_coo_tensor`` converts int32 indices, checked on torch 2.13), so
    ``index_dtype`` applies to CSR only.
    Source: the layouts in ``aten/src/ATen/SparseCsrTensorImpl.h`` / ``SparseTensorImpl.h``.
    """
    _check_matrix(rows, cols)
    if not isinstance(nnz, int) or isinstance(nnz, bool) or not 0 <= nnz <= rows * cols:
        raise ValueError(f"nnz={nnz!r} must be an integer in [0, {rows * cols}]")
    if fmt not in ("dense", "csr", "coo"):
        raise ValueError(f"fmt={fmt!r} is not one of ('dense', 'csr', 'coo')")
    if index_dtype not in INDEX_DTYPES:
        raise ValueError(f"index_dtype={index_dtype!r} is not one of {INDEX_DTYPES}")
    idx = INDEX_ITEMSIZE[index_dtype]
    if fmt == "dense":
        return {"values": rows * cols * value_itemsize}
    if fmt == "csr":
        return {
            "values": nnz * value_itemsize,
            "col_indices": nnz * idx,
            "crow_indices": (rows + 1) * idx,
        }
    return {"values": nnz * value_itemsize, "indices": 2 * nnz * INDEX_ITEMSIZE["int64"]}


SEMI_STRUCTURED_MIN_SHAPE = {1: (16, 128), 2: (32, 64), 4: (32, 32)}
"""(rows, cols) multiples ``SparseSemiStructuredTensorCUTLASS`` requires per value itemsize
(int8, fp16/bf16, fp32): ``_DTYPE_SHAPE_CONSTRAINTS`` in ``torch/sparse/semi_structured.py``."""


def semi_structured_bytes(rows: int, cols: int, value_itemsize: int) -> dict[str, int]:
    """Bytes of a ``rows x cols`` weight in 2:4 semi-structured form, CUTLASS layout
    (``torch/sparse/_semi_structured_conversions.py``,
    ``sparse_semi_structured_from_dense_cutlass``):

    * ``packed``: the kept half, ``rows x cols/2`` values;
    * ``meta``: 4 bits per kept pair; fp16/bf16 (2 of 4): int16 ``rows x cols/16``; fp32 (1 of
      2, same bytes as 2:4): int16 ``rows x cols/8``; int8: int32 ``rows x cols/32``.

    So 56.25 % of dense for fp16/bf16/fp32 and 62.5 % for int8 (memory-facts.md §2.10).
    Raises ``ValueError`` for a shape the CUTLASS backend rejects. Checked on CPU against the
    conversion function above; ``to_sparse_semi_structured`` itself runs on CUDA only (torch
    2.13 raises "Only CUDA tensors are currently supported" on CPU), and a 2:4 matmul's
    transients are not modelled. Training with the transposed copies (``packed_t``,
    ``meta_t``) doubles these bytes.
    """
    _check_matrix(rows, cols)
    if value_itemsize not in SEMI_STRUCTURED_MIN_SHAPE:
        raise ValueError(
            f"value_itemsize={value_itemsize!r} must be 1 (int8), 2 (fp16/bf16) or 4 (fp32)"
        )
    mr, mc = SEMI_STRUCTURED_MIN_SHAPE[value_itemsize]
    if rows % mr or cols % mc:
        raise ValueError(
            f"shape ({rows}, {cols}) is not supported by 2:4 (CUTLASS): rows must be a multiple "
            f"of {mr} and cols of {mc} for {value_itemsize}-byte values"
        )
    packed = rows * (cols // 2) * value_itemsize
    if value_itemsize == 1:
        meta = rows * (cols // 32) * 4
    elif value_itemsize == 2:
        meta = rows * (cols // 16) * 2
    else:
        meta = rows * (cols // 8) * 2
    return {"packed": packed, "meta": meta}


def break_even_nnz(
    rows: int, cols: int, fmt: str, value_itemsize: int, index_dtype: str = "int64"
) -> int:
    """The largest number of non-zeros at which ``fmt`` (``csr`` or ``coo``) takes fewer bytes
    than the dense matrix (-1 if none does): from `sparse_bytes`, CSR saves when
    ``nnz*(itemsize+idx) + (rows+1)*idx < rows*cols*itemsize``, COO when
    ``nnz*(itemsize+2*idx) < rows*cols*itemsize``."""
    if fmt not in ("csr", "coo"):
        raise ValueError(f"fmt={fmt!r} must be 'csr' or 'coo'")
    dense = rows * cols * value_itemsize
    idx = INDEX_ITEMSIZE.get(index_dtype)
    if idx is None:
        raise ValueError(f"index_dtype={index_dtype!r} is not one of {INDEX_DTYPES}")
    fixed = (rows + 1) * idx if fmt == "csr" else 0
    per_nnz = value_itemsize + (idx if fmt == "csr" else 2 * INDEX_ITEMSIZE["int64"])
    # largest nnz with fixed + nnz * per_nnz < dense
    room = dense - fixed
    return min(rows * cols, (room - 1) // per_nnz) if room > 0 else -1


@dataclass(frozen=True, slots=True)
class StorageVerdict:
    """How the pruned weights of a model are best stored, with the numbers behind it."""

    dense_bytes: int
    """The pruned weights stored dense (zeros included), each tensor rounded to 512 B."""
    bytes_by_format: dict[str, int]
    """Bytes of the pruned weights in each format that applies (``csr``, ``coo``, and ``2:4``
    for a 2:4 mask on supported shapes), allocator-rounded per tensor."""
    density: Fraction
    """Non-zeros / elements over the pruned weights."""
    break_even_density: dict[str, Fraction]
    """Per sparse format, the density below which it saves memory on the largest pruned
    weight (``nnz / numel`` at `break_even_nnz` + 1)."""
    best: str
    """The format with the fewest bytes (``dense`` when no sparse format saves)."""


def storage_verdict(
    model: ModelSpec, pruning: Pruning, value_itemsize: int, index_dtype: str = "int64"
) -> StorageVerdict:
    """Which storage saves memory for the pruned weights of ``model`` (all layers), each tensor
    charged ``round_block`` bytes (the CUDA caching allocator's 512-byte blocks)."""
    if not isinstance(pruning, Pruning):
        raise ValueError(f"pruning={pruning!r} must be a calc.Pruning")
    shapes = pruned_shapes(model, pruning)
    total: dict[str, int] = {"dense": 0, "csr": 0, "coo": 0}
    two4_ok = pruning.kind == "2:4"
    two4 = 0
    nnz_all = numel_all = 0
    for rows, cols in shapes:
        nnz = pruned_nnz(rows * cols, pruning.amount)
        nnz_all += nnz * model.n_layers
        numel_all += rows * cols * model.n_layers
        for fmt in total:
            parts = sparse_bytes(rows, cols, nnz, fmt, value_itemsize, index_dtype)
            total[fmt] += model.n_layers * sum(round_block(b) for b in parts.values())
        if two4_ok:
            try:
                parts = semi_structured_bytes(rows, cols, value_itemsize)
            except ValueError:
                two4_ok = False
            else:
                two4 += model.n_layers * sum(round_block(b) for b in parts.values())
    by_format = {k: v for k, v in total.items() if k != "dense"}
    if two4_ok:
        by_format["2:4"] = two4
    rows, cols = max(shapes, key=lambda rc: rc[0] * rc[1])
    even = {
        fmt: Fraction(break_even_nnz(rows, cols, fmt, value_itemsize, index_dtype) + 1, rows * cols)
        for fmt in ("csr", "coo")
    }
    best = min(by_format, key=by_format.__getitem__)
    if by_format[best] >= total["dense"]:
        best = "dense"
    return StorageVerdict(
        dense_bytes=total["dense"],
        bytes_by_format=by_format,
        density=Fraction(nnz_all, numel_all),
        break_even_density=even,
        best=best,
    )


def _check_matrix(rows: object, cols: object) -> None:
    for name, v in (("rows", rows), ("cols", cols)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive integer")
