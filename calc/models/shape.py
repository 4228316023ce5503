"""`Shape`: the sizes and structure of one replayed step, shared by every model graph."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from calc import symbols as S
from calc.config.jobs import Inference
from calc.config.model_spec import ModelSpec
from calc.models.attention import kernel_for
from calc.replay.tape import Size, divide

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of weights, activations and the KV cache for each inference precision."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """Sizes (ints or sympy expressions) and structure of one replayed step."""

    b: Size
    s: Size
    h: Size
    a: Size
    k: Size
    d: Size
    f: Size
    V: Size
    P: Size
    n_layers: int
    model_type: str
    mlp: str
    norm: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    norm_bias: bool
    qk_norm: bool
    tied: bool
    weight_itemsize: int
    """Bytes per element of the parameters as the model holds them (4 fp32, 2 bf16)."""
    act_itemsize: int
    """Bytes per element of the residual stream (the embedding output's dtype)."""
    autocast_itemsize: int = 0
    """Bytes per element of autocast's lower precision (2), or 0 when autocast is off."""
    attention: str = "flash"
    """The attention kernel that runs: ``flash``/``efficient``/``math`` (SDPA) or ``eager``."""
    recompute: str = "none"
    """``none``, ``selective`` (attention core checkpointed), ``full`` (every layer) or ``op``
    (torchtitan's op-level policy)."""
    recompute_every: int = 1
    """With ``full``: torchtitan checkpoints every n-th block only (`calc.models.torchtitan`)."""
    attn_dropout: float = 0.0
    hidden_dropout: float = 0.0
    embed_dropout: float = 0.0
    device: str = "cpu"
    """``cpu`` (the tracker's run) or ``cuda``: decides kernels that differ (dropout masks)."""
    flash_head_pad: int = 0
    """``d_rounded - d`` of the CUDA flash backward's fp32 ``dq_accum``
    (`calc.models.attention.flash_head_pad`); 0 when the head dim is a multiple of its rounding."""
    gqa: bool | None = None
    """Whether k < a (decides repeat/expand paths when sizes are symbols)."""
    tp_comm: bool = False
    """Tensor parallelism's column/row linears with their all-reduces (`calc.parallel.tensor`);
    the sizes are then those of one rank."""
    tp_vocab: bool = False
    """The embedding and the head split over the vocabulary (``V`` is then one rank's share):
    the embedding's partial output all-reduced, the head column-parallel."""
    sp: int = 1
    """Sequence parallelism over ``sp`` (= tp) ranks, or 1 (`calc.parallel.sequence`): the
    norms and the residual stream hold ``b*s/sp`` rows, the attention and MLP inputs are
    all-gathered, row-parallel outputs reduce-scattered, the head column-parallel."""

    @property
    def head_split(self) -> int:
        """Ranks the head's rows are split over beyond ``V`` (``V`` already one rank's share
        under ``tp_vocab``): ``sp`` for a sequence-parallel head, else 1."""
        return self.sp if self.sp > 1 and not self.tp_vocab else 1

    @property
    def local_rows(self) -> Size:
        """Rows of the residual stream on one rank: ``b*s``, or ``b*s/sp``."""
        return divide(self.b * self.s, self.sp) if self.sp > 1 else self.b * self.s


def shape_for_inference(model: ModelSpec, job: Inference, device: str, n_layers: int) -> Shape:
    """The prefill's symbolic shape (``s`` is the prompt length; no dropout: eval mode)."""
    kernel = kernel_for(model, job, device, 0.0)
    w = ITEMSIZE[job.precision]
    return Shape(
        b=S.b, s=S.s, h=S.h, a=S.a, k=S.k, d=S.d, f=S.f, V=S.V, P=S.P,
        n_layers=n_layers,
        model_type=model.model_type, mlp=model.mlp, norm=model.norm,
        qkv_bias=model.qkv_bias, o_bias=model.o_bias, mlp_bias=model.mlp_bias,
        norm_bias=model.norm_bias, qk_norm=model.qk_norm, tied=model.tied_embeddings,
        weight_itemsize=w, act_itemsize=w, attention=kernel, device=device,
    )  # fmt: skip


def sized_for(sh: Shape, model: ModelSpec, job: Inference) -> Shape:
    """``sh`` with every symbolic size replaced by this model's and job's int (the batch, the
    prompt length and the model's dimensions): a shape to replay with concrete sizes."""
    dims = model.dims()
    return replace(
        sh, b=job.batch, s=job.prompt_len, h=dims[S.h], a=dims[S.a], k=dims[S.k], d=dims[S.d],
        f=dims[S.f], V=dims[S.V], P=dims[S.P],
    )  # fmt: skip


def numeric_shape(
    model: ModelSpec, job: Inference, device: str,
    check: Callable[[ModelSpec, Inference, Shape], None], n_layers: int | None = None,
) -> tuple[Shape, int]:  # fmt: skip
    """The prefill's shape with every size an int (this model and job), after ``check`` (the
    implementation's refusals), and the context length."""
    sh = shape_for_inference(model, job, device, model.n_layers if n_layers is None else n_layers)
    check(model, job, sh)
    return sized_for(sh, model, job), job.context
