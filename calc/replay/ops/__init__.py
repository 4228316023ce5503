"""The op library: the ops the modelled code runs, each with what it allocates, saves and frees.

Each function mirrors one ATen op and its entry in PyTorch's ``tools/autograd/derivatives.yaml``
(torch 2.13): which inputs or outputs autograd saves (only those the backward formula needs,
and only when the gradient they serve is required: ``should_compute_output`` guards), and which
tensors the backward formula allocates, in order. Temporaries of one C++ expression live until
its end. Views allocate nothing. Every graph (`calc.models`, `calc.parallel`, `calc.compress`,
`calc.step`) calls them as ``ops.<name>``; one name per op:

- ``views``: `view`, `clone`, `expand`, `repeat_interleave`, `slice_half`, `slice_last`, `split3`, `chunk2`,
  `cat2`, `cat_onto_empty`, `plain`;
- ``casts``: `to_dtype`, `autocast_cast` (the one autocast model);
- ``elementwise``: `mul`, `mul_broadcast`, `add`, `add_cast_in_formula`, `scale`, `unary`,
  `neg`, `softmax`, `pow2`, `rsqrt`, `mean_last`, `masked_fill`, `dropout`, `numel_ge`;
- ``matmul``: `linear`, `bmm`, `matmul`, `embedding`;
- ``norm``: `layer_norm`;
- ``attention``: `sdpa_flash` (with `CudaFlash`, the CUDA kernel's own tensors), `causal_bias`;
- ``loss``: `cross_entropy`, `log_softmax`.
"""

from __future__ import annotations

from calc.replay.ops.attention import CudaFlash, causal_bias, sdpa_flash
from calc.replay.ops.casts import autocast_cast, to_dtype
from calc.replay.ops.elementwise import (
    add,
    add_cast_in_formula,
    dropout,
    masked_fill,
    mean_last,
    mul,
    mul_broadcast,
    neg,
    numel_ge,
    pow2,
    rsqrt,
    scale,
    softmax,
    unary,
)
from calc.replay.ops.loss import cross_entropy, log_softmax
from calc.replay.ops.matmul import bmm, embedding, linear, matmul
from calc.replay.ops.norm import layer_norm
from calc.replay.ops.views import (
    cat2,
    cat_onto_empty,
    chunk2,
    clone,
    expand,
    plain,
    repeat_interleave,
    slice_half,
    slice_last,
    split3,
    view,
)

__all__ = [
    "CudaFlash",
    "add",
    "add_cast_in_formula",
    "autocast_cast",
    "bmm",
    "cat2",
    "cat_onto_empty",
    "causal_bias",
    "chunk2",
    "clone",
    "cross_entropy",
    "dropout",
    "embedding",
    "expand",
    "layer_norm",
    "linear",
    "log_softmax",
    "masked_fill",
    "matmul",
    "mean_last",
    "mul",
    "mul_broadcast",
    "neg",
    "numel_ge",
    "plain",
    "pow2",
    "repeat_interleave",
    "rsqrt",
    "scale",
    "sdpa_flash",
    "slice_half",
    "slice_last",
    "softmax",
    "split3",
    "to_dtype",
    "unary",
    "view",
]
