"""torchtitan's Llama 3 (``implementation="torchtitan"``): a faithful small copy of its model
code and of its trainer's loss step, torchtitan 0.2.2.

0.2.2 is the last release whose language models run ``F.scaled_dot_product_attention`` (its
default ``attn_type="sdpa"``); 0.3.0 refuses SDPA for them and runs flex attention, which
needs ``torch.compile``. torchtitan installs from the package index, but its package imports
a data and logging stack at module level that verify does not need; verify runs this copy, and
``tests/verify/models/test_torchtitan_llama.py`` compares it with the library itself (same
weights: same loss and gradients, same bytes on the CPU tracker) wherever torchtitan imports.
Every op that decides memory follows torchtitan 0.2.2 (``torchtitan/models/llama3/model/
model.py`` unless named):

* ``nn.RMSNorm(dim, eps=norm_eps)`` itself for every norm (``TransformerBlock.__init__``,
  ``Transformer.__init__``);
* one complex64 ``freqs_cis`` buffer [max_seq_len, head_dim/2] on the root
  (``precompute_freqs_cis``), ``max_seq_len`` set to the training sequence length
  (``TransformerModelArgs.update_from_config``); ``apply_rotary_emb`` (lines 141-169) upcasts
  (``xq.float()``), views pairs as complex numbers, multiplies by the buffer's first
  ``seq_len`` rows (``reshape_for_broadcast``: a view), ``view_as_real(...).flatten(3)``,
  ``type_as(xq)``;
* ``Attention.forward`` (lines 229-305): ``wq``, ``wk``, ``wv``, views, RoPE, transposes,
  ``ScaledDotProductAttentionWrapper`` (models/attention.py:156-197: ``F.scaled_dot_product_
  attention(..., is_causal=True, enable_gqa=n_heads > n_kv_heads)`` under ``sdpa_kernel([
  CUDNN_ATTENTION, FLASH_ATTENTION, MATH])``), ``.transpose(1, 2).contiguous()``,
  ``view(bs, seqlen, -1)``, ``wo``;
* ``FeedForward.forward``: ``w2(silu(w1(x)) * w3(x))``;
* ``TransformerBlock.forward`` and ``Transformer.forward``: the final norm, ``output`` (the
  logits in the compute dtype, returned);
* the trainer's step (train.py ``train_step``, ``forward_backward_step``; components/loss.py
  ``cross_entropy_loss``): the valid tokens counted (``(labels != IGNORE_INDEX).sum()``),
  ``pred = model(inputs)``, ``cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1),
  reduction="sum")`` divided by the count, ``del pred``, backward. torchtitan counts on the
  host and moves one 0-d tensor to the GPU; here the count's mask is made beside the model
  (a transient of ``b * s`` bytes before the forward).

Parameters are registered in torchtitan's order (``tok_embeddings``; per layer ``attention.
wq, wk, wv, wo``, ``feed_forward.w1, w2, w3``, ``attention_norm``, ``ffn_norm``; ``norm``,
``output``). Activation checkpointing checkpoints each block as ``apply_ac`` does
(distributed/activation_checkpoint.py): ``ptd_checkpoint_wrapper`` is non-reentrant
``torch.utils.checkpoint`` with the ``ActivationCheckpoint`` config's arguments, whose
``early_stop`` is False (config/job_config.py): the recomputation runs the whole block again.
``recompute="full"`` is its ``mode="full"``, with ``recompute_every=n`` its ``mode=
"selective"``, ``selective_ac_option="n"`` (``_apply_layer_sac``: blocks n-1, 2n-1, ...);
``recompute="op"`` its ``selective_ac_option="op"``, whose ``_custom_policy`` with llama3's
save list is `verify.models.sac`'s. The labels are the protocol's targets (torchtitan's
dataloader shifts them; the bytes are the same).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from verify.models import sac

if TYPE_CHECKING:
    from calc.config.jobs import Training
    from calc.config.model_spec import ModelSpec

IGNORE_INDEX = -100
"""torchtitan's ``IGNORE_INDEX`` (components/loss.py)."""


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    """``polar(1, outer(t, freqs))``: complex64 [end, head_dim/2] (the ``llama`` frequency
    scaling changes values, not sizes: left out)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    t = torch.arange(end, device=freqs.device)
    angles = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in fp32 complex arithmetic on ``[b, s, heads, head_dim]``."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    seqlen = xq_.shape[1]
    freqs_cis = freqs_cis[0:seqlen].view(1, seqlen, 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    """torchtitan's ``Attention`` with the SDPA backend."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        a, kv, hd = spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.enable_gqa = a > kv
        self.head_dim = hd
        self.wq = nn.Linear(spec.hidden, a * hd, bias=False)
        self.wk = nn.Linear(spec.hidden, kv * hd, bias=False)
        self.wv = nn.Linear(spec.hidden, kv * hd, bias=False)
        self.wo = nn.Linear(a * hd, spec.hidden, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        output = (
            F.scaled_dot_product_attention(xq, xk, xv, is_causal=True, enable_gqa=self.enable_gqa)
            .transpose(1, 2)
            .contiguous()
        )
        output = output.view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.w1 = nn.Linear(spec.hidden, spec.ffn, bias=False)
        self.w2 = nn.Linear(spec.ffn, spec.hidden, bias=False)
        self.w3 = nn.Linear(spec.hidden, spec.ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """``h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h))``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attention = Attention(spec)
        self.feed_forward = FeedForward(spec)
        self.attention_norm = nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
        self.ffn_norm = nn.RMSNorm(spec.hidden, eps=spec.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


class Transformer(nn.Module):
    """torchtitan's Llama 3 ``Transformer``: returns the logits."""

    def __init__(
        self, spec: ModelSpec, max_seq_len: int, recompute: str = "none", every: int = 1
    ) -> None:
        super().__init__()
        if spec.model_type not in ("llama", "mistral") or spec.qk_norm or spec.qkv_bias:
            raise ValueError(f"model_type={spec.model_type!r}: the copy has torchtitan's Llama 3")
        self.recompute = recompute
        self.every = every
        self.tok_embeddings = nn.Embedding(spec.vocab, spec.hidden)
        freqs = precompute_freqs_cis(spec.head_dim, max_seq_len, spec.rope_theta or 10000.0)
        self.register_buffer("freqs_cis", freqs, persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec) for i in range(spec.n_layers)})
        self.norm = nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
        self.output = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for count, layer in enumerate(self.layers.values(), 1):
            if self.training and self.checkpointed(count):
                h = checkpoint(layer, h, self.freqs_cis, **checkpoint_kwargs(self.recompute))
            else:
                h = layer(h, self.freqs_cis)
        h = self.norm(h)
        return self.output(h)

    def checkpointed(self, count: int) -> bool:
        """``apply_ac``'s choice for the ``count``-th block (from 1): every block in full and
        op modes; with a layer frequency n (``_apply_layer_sac``) the blocks whose count is a
        multiple of n (its counter is global to the process, and each case runs one model)."""
        if self.recompute == "none":
            return False
        return self.recompute == "op" or count % self.every == 0


def checkpoint_kwargs(recompute: str) -> dict[str, Any]:
    """``ptd_checkpoint_wrapper``'s arguments in ``_apply_full_ac`` and ``_apply_op_sac``: the
    ``ActivationCheckpoint`` defaults (``preserve_rng_state=True``, ``determinism_check=
    "default"``, ``early_stop=False``, ``debug=False``), non-reentrant; by op, the policy's
    contexts."""
    kwargs: dict[str, Any] = {
        "use_reentrant": False,
        "preserve_rng_state": True,
        "determinism_check": "default",
        "early_stop": False,
        "debug": False,
    }
    if recompute == "op":
        kwargs["context_fn"] = sac.block_contexts
    return kwargs


def build(spec: ModelSpec, job: Training, dtype: torch.dtype) -> Transformer:
    """The model with parameters in ``dtype`` and a complex64 ``freqs_cis`` of ``job.seq_len``
    rows (``update_from_config``); ``Module.to`` leaves complex buffers as they are."""
    if job.recompute not in ("none", "full", "op"):
        raise ValueError("the copy checkpoints blocks whole or by op: recompute='full' or 'op'")
    if spec.tied_embeddings:
        raise ValueError("torchtitan's Llama 3 has no tied embeddings")
    model = Transformer(spec, job.seq_len, job.recompute, job.recompute_every)
    if dtype != torch.float32:
        model.to(dtype)
    return model


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """components/loss.py ``cross_entropy_loss``: the logits upcast, ``reduction="sum"``."""
    return F.cross_entropy(
        pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
        ignore_index=IGNORE_INDEX,
    )  # fmt: skip


class TrainerLoss:
    """The trainer's loss step as the ``(ids, targets) -> loss`` of the training protocol:
    the count of valid tokens, the model's logits, the loss divided by the count, ``del pred``.
    ``call``: what the loop calls for the whole model (the model, or FSDP2's root: the same
    module, wrapped in place)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        valid = (targets != IGNORE_INDEX).sum()
        pred = self.model(ids)
        loss = cross_entropy_loss(pred, targets) / valid
        del pred
        return loss
