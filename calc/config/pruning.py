"""Pruning: what it costs while training, and what sparse storage saves afterwards.

Three kinds users meet (memory-facts.md §2.10, checked against torch 2.13's source):

* **unstructured**, with ``torch.nn.utils.prune`` while training: each pruned module keeps the
  parameter ``weight_orig``, a buffer ``weight_mask`` (``ones_like(orig)`` with zeros: the
  weight's dtype) and the attribute ``weight = mask.to(orig.dtype) * orig``, recomputed by a
  forward pre-hook at every call (``torch/nn/utils/prune.py``, ``BasePruningMethod.apply``,
  ``apply_mask``, ``__call__``). Memory goes *up* (two more weight-sized tensors per pruned
  weight) until ``prune.remove``, after which the weight is dense again, zeros included: no
  saving. The replay of the reparameterised step is `calc.compress.prune_replay`; the storage a pruned
  weight could take in a sparse format (CSR or COO), and the density below which that saves
  anything, are `sparse_bytes` / `break_even_nnz` here.
* **2:4 semi-structured**: two values of every four kept, packed, plus metadata
  (`semi_structured_bytes`).
* **structured** (heads, FFN channels, whole layers): a smaller dense model, `pruned_spec`
  (every other term of the cost model then shrinks with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, get_args

from calc.config.model_spec import ModelSpec
from calc.replay.tape import round_block

PruningKind = Literal["unstructured", "2:4"]
SparseFormat = Literal["dense", "csr", "coo", "2:4"]
IndexDtype = Literal["int64", "int32"]

PRUNING_KINDS: tuple[str, ...] = get_args(PruningKind)
SPARSE_FORMATS: tuple[str, ...] = get_args(SparseFormat)
INDEX_DTYPES: tuple[str, ...] = get_args(IndexDtype)
INDEX_ITEMSIZE = {"int64": 8, "int32": 4}
LLAMA_MODULES: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
"""Prunable linears of a llama-family layer (the replay's names for q_proj ... down_proj)."""
GPT2_MODULES: tuple[str, ...] = ("qkv", "o", "fc", "proj")
"""Prunable linears of a GPT-2 layer (c_attn, attn.c_proj, c_fc, mlp.c_proj)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Pruning:
    """Unstructured or 2:4 pruning of the decoder layers' linear weights with
    ``torch.nn.utils.prune`` (for structured pruning, see `pruned_spec`)."""

    kind: PruningKind = "unstructured"
    """``unstructured`` (``prune.l1_unstructured`` at ``amount``) or ``2:4`` (a mask keeping
    two of every four consecutive weights of a row, applied with ``prune.custom_from_mask``
    and a mask in the weight's dtype, which the pruning method keeps: one more weight-sized
    tensor per pruned weight)."""
    amount: float = 0.5
    """Fraction of each pruned weight set to zero, in [0, 1]; ``torch.nn.utils.prune`` zeroes
    ``round(amount * numel)`` entries. 2:4 is always 0.5."""
    modules: tuple[str, ...] | None = None
    """Which linears of every layer are pruned: llama family ``q k v o gate up down``, GPT-2
    ``qkv o fc proj``. ``None``: all of them."""
    removed: bool = False
    """Whether ``prune.remove`` ran before the step: the weights are then plain dense tensors
    (with zeros) and the step costs what an unpruned one does."""

    def __post_init__(self) -> None:
        if self.kind not in PRUNING_KINDS:
            raise ValueError(f"kind={self.kind!r} is not one of {PRUNING_KINDS}")
        ok = isinstance(self.amount, int | float) and not isinstance(self.amount, bool)
        if not ok or not 0 <= self.amount <= 1:
            raise ValueError(f"amount={self.amount!r} must be a number in [0, 1]")
        if self.kind == "2:4" and self.amount != 0.5:
            raise ValueError(f"amount={self.amount} must be 0.5 for kind='2:4'")
        if self.modules is not None:
            allowed = LLAMA_MODULES + GPT2_MODULES
            if not isinstance(self.modules, tuple) or not self.modules:
                raise ValueError(f"modules={self.modules!r} must be a non-empty tuple or None")
            for m in self.modules:
                if m not in allowed:
                    raise ValueError(f"modules entry {m!r} is not one of {allowed}")
            if len(set(self.modules)) != len(self.modules):
                raise ValueError(f"modules={self.modules!r} lists a module twice")
        if not isinstance(self.removed, bool):
            raise ValueError(f"removed={self.removed!r} must be a bool")

    def modules_for(self, model: ModelSpec) -> tuple[str, ...]:
        """The pruned linears of ``model``'s layers; ``ValueError`` for a name it lacks, or
        (2:4) for a weight whose input width is not a multiple of 4."""
        own = GPT2_MODULES if model.model_type == "gpt2" else LLAMA_MODULES
        if self.modules is not None:
            for m in self.modules:
                if m not in own:
                    raise ValueError(
                        f"modules entry {m!r} does not exist in a {model.model_type} layer: "
                        f"allowed {own}"
                    )
        keys = own if self.modules is None else tuple(m for m in own if m in self.modules)
        if self.kind == "2:4":
            for key, (_, cols) in zip(keys, _shapes(model, keys), strict=True):
                if cols % 4:
                    raise ValueError(
                        f"kind='2:4' needs the input width of {key!r} ({cols}) to be a "
                        "multiple of 4 (two of every four weights of a row are kept)"
                    )
        return keys


def pruned_nnz(numel: int, amount: float) -> int:
    """Non-zeros left in a tensor of ``numel`` elements pruned at ``amount``:
    ``numel - round(amount * numel)`` (``torch/nn/utils/prune.py``,
    ``_compute_nparams_toprune``: Python's ``round``, ties to even)."""
    return numel - round(amount * numel)


# ------------------------------------------------------------------ sparse storage


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


def pruned_shapes(model: ModelSpec, pruning: Pruning) -> list[tuple[int, int]]:
    """``(out, in)`` of each pruned weight of one layer, in the layer's order."""
    return _shapes(model, pruning.modules_for(model))


def _shapes(model: ModelSpec, keys: tuple[str, ...]) -> list[tuple[int, int]]:
    h, a, k, d, f = model.hidden, model.n_heads, model.n_kv_heads, model.head_dim, model.ffn
    shape = {
        "q": (a * d, h), "k": (k * d, h), "v": (k * d, h), "o": (h, a * d),
        "gate": (f, h), "up": (f, h), "down": (h, f),
        "qkv": (3 * h, h), "fc": (f, h), "proj": (h, f),
    }  # fmt: skip
    return [shape[m] for m in keys]


def _check_matrix(rows: object, cols: object) -> None:
    for name, v in (("rows", rows), ("cols", cols)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive integer")


# ------------------------------------------------------------------ structured pruning


def pruned_spec(
    model: ModelSpec,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    ffn: int | None = None,
    n_layers: int | None = None,
) -> ModelSpec:
    """The dense model left after structured pruning: attention heads removed (``n_heads``
    query heads kept, ``n_kv_heads`` key/value heads), FFN channels removed (``ffn`` kept) or
    whole layers dropped (``n_layers`` kept). Head width and hidden size stay, so the
    projections shrink to ``n_heads*head_dim`` rows (Michel et al. 2019, "Are Sixteen Heads
    Really Better than One?"; Sheared-LLaMA, Xia et al. 2023, prunes the same dimensions).

    Validated: each kept count is at least 1 and at most the model's; kept query heads must be
    a multiple of the kept KV heads (GQA groups stay whole); GPT-2's fused ``c_attn`` needs
    ``n_heads * head_dim == hidden``, so its heads cannot be pruned.
    """
    if not isinstance(model, ModelSpec):
        raise ValueError(f"model must be a calc.ModelSpec, got {type(model).__name__}")
    changes: dict[str, int] = {}
    for field, value, current in (
        ("n_heads", n_heads, model.n_heads),
        ("n_kv_heads", n_kv_heads, model.n_kv_heads),
        ("ffn", ffn, model.ffn),
        ("n_layers", n_layers, model.n_layers),
    ):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= current:
            raise ValueError(f"{field}={value!r} must be an integer in [1, {current}] (kept)")
        changes[field] = value
    heads = changes.get("n_heads", model.n_heads)
    kv = changes.get("n_kv_heads", model.n_kv_heads)
    if model.n_kv_heads == model.n_heads and "n_heads" in changes and "n_kv_heads" not in changes:
        kv = heads  # multi-head attention stays multi-head
        changes["n_kv_heads"] = kv
    if heads % kv:
        raise ValueError(
            f"n_heads={heads} must be a multiple of n_kv_heads={kv}: each kept KV head serves "
            f"a whole group of query heads (GQA)"
        )
    if model.model_type == "gpt2" and ("n_heads" in changes or "n_kv_heads" in changes):
        if heads != model.n_heads or kv != model.n_kv_heads:
            raise ValueError(
                f"n_heads={heads}: gpt2's fused c_attn needs n_heads * head_dim == hidden, "
                "so its heads cannot be pruned (prune ffn or layers)"
            )
    if not changes:
        return model
    return model.with_overrides(name=f"{model.name}-pruned", **changes)
