"""torchtune's Llama (``implementation="torchtune"``): a faithful small copy of its model code.

torchtune 0.6.1 installs from the package index but pulls in datasets, torchdata, torchao and a
tokenizer stack that verify does not need; verify runs this copy, and
``tests/verify/models/test_torchtune_llama.py`` compares it with the library itself (same
weights: same loss and gradients, same bytes on the CPU tracker) wherever torchtune imports.
Every op that decides memory follows torchtune 0.6.1 (``torchtune/...`` paths below):

* ``RMSNorm.forward`` (modules/rms_norm.py:44-51): ``F.rms_norm(x.float(), (dim,), weight=scale,
  eps=eps).to(x.dtype)``: the norm runs in fp32 whatever the model's dtype;
* ``RotaryPositionalEmbeddings`` (modules/position_embeddings.py:46-122): one module shared by
  every layer (models/llama3/_component_builders.py:88), an fp32 ``theta`` [d/2] and ``cache``
  [max_seq_len, d/2, 2]; ``forward`` upcasts (``x.float()``), pairs the last dimension
  (interleaved, not ``rotate_half``), ``torch.stack`` of four products, ``type_as(x)``;
* ``MultiHeadAttention.forward`` (modules/attention.py:231-304): q/k/v projections, RoPE in the
  ``[b, s, heads, d]`` layout before the transpose, grouped k/v expanded to every query head
  (``unsqueeze(2).expand(...).flatten(1, 2)``: a copy), ``F.scaled_dot_product_attention(...,
  is_causal=True)`` (modules/attention_utils.py ``_sdpa_call``), ``output_proj``;
* ``FeedForward`` (modules/feed_forward.py:50-54): ``w2(silu(w1(x)) * w3(x))``;
* ``TransformerSelfAttentionLayer.forward`` (modules/transformer.py:121-132) and
  ``TransformerDecoder.unembed`` (modules/transformer.py:653-663): the final norm, then the
  logits upcast (``self.output(h).float()``) or, with ``num_output_chunks``, ``[output(c) for c
  in h.chunk(k, dim=1)]``;
* the recipe's ``_loss_step`` (recipes/full_finetune_single_device.py:630-653): labels shifted
  by ``torch.hstack``, the loss on the logits, ``del logits``; the losses
  ``torch.nn.CrossEntropyLoss`` on ``logits.reshape(-1, V)`` and ``CEWithChunkedOutputLoss``
  (modules/loss/ce_chunked_output_loss.py:35-83). The recipe's scaling of the loss by the token
  count (a 0-d product) is left out.

Parameters are registered in torchtune's order (``tok_embeddings``; per layer ``attn.{q,k,v,
output}_proj``, ``mlp.w1, w2, w3``, ``sa_norm``, ``mlp_norm``; ``norm``, ``output``).
Activation checkpointing (``recompute="full"``) wraps each layer as
``training.set_activation_checkpointing`` does (non-reentrant ``torch.utils.checkpoint``);
activation offloading (``offload_activations``) wraps the model's forward in
`verify.models.offload`'s copy of ``OffloadActivations``, its head in ``NoOpManager``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from verify.models import offload

if TYPE_CHECKING:
    from calc.config.jobs import Training
    from calc.config.model_spec import ModelSpec

IGNORE_INDEX = -100
"""torchtune's ``CROSS_ENTROPY_IGNORE_IDX``."""


class RMSNorm(nn.Module):
    """torchtune's RMSNorm: fp32 ``F.rms_norm`` of an upcast copy, cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), self.normalized_shape, weight=self.scale, eps=self.eps)
        return out.to(x.dtype)


class RotaryPositionalEmbeddings(nn.Module):
    """Interleaved RoPE over an fp32 cache of ``max_seq_len`` positions."""

    def __init__(self, dim: int, max_seq_len: int, base: float) -> None:
        super().__init__()
        self.dim, self.max_seq_len, self.base = dim, max_seq_len, base
        self.rope_init()

    def rope_init(self) -> None:
        """The fp32 buffers (``theta`` [d/2], ``cache`` [max_seq_len, d/2, 2])."""
        idx = torch.arange(0, self.dim, 2)[: self.dim // 2].float() / self.dim
        theta = 1.0 / (self.base**idx)
        self.register_buffer("theta", theta, persistent=False)
        seq = torch.arange(self.max_seq_len, dtype=theta.dtype)
        angles = torch.einsum("i, j -> ij", seq, theta).float()
        cache = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)
        self.register_buffer("cache", cache, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_len = x.size(1)
        rope = self.cache[:seq_len]
        xs = x.float().reshape(*x.shape[:-1], -1, 2)
        rope = rope.view(-1, xs.size(1), 1, xs.size(3), 2)
        out = torch.stack(
            [
                xs[..., 0] * rope[..., 0] - xs[..., 1] * rope[..., 1],
                xs[..., 1] * rope[..., 0] + xs[..., 0] * rope[..., 1],
            ],
            -1,
        )
        return out.flatten(3).type_as(x)


class MultiHeadAttention(nn.Module):
    """torchtune's self-attention (no KV cache, no q/k norms)."""

    def __init__(self, spec: ModelSpec, rope: RotaryPositionalEmbeddings) -> None:
        super().__init__()
        h, a, kv, hd = spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = a, kv, hd
        self.q_proj = nn.Linear(h, a * hd, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, kv * hd, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, kv * hd, bias=spec.qkv_bias)
        self.output_proj = nn.Linear(a * hd, h, bias=spec.o_bias)
        self.pos_embeddings = rope
        self.attn_dropout = spec.attention_dropout

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, s_x, _ = x.shape
        s_y = y.shape[1]
        q_per_kv = self.num_heads // self.num_kv_heads
        q = self.q_proj(x)
        q = q.view(b, s_x, self.num_kv_heads * q_per_kv, self.head_dim)
        q = self.pos_embeddings(q)
        q = q.transpose(1, 2)
        k = self.k_proj(y)
        v = self.v_proj(y)
        k = k.view(b, s_y, -1, self.head_dim)
        v = v.view(b, s_y, -1, self.head_dim)
        k = self.pos_embeddings(k)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        if self.num_heads != self.num_kv_heads:
            shape = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(shape).flatten(1, 2)
        p_drop = self.attn_dropout if self.training else 0.0
        output = F.scaled_dot_product_attention(q, k, v, dropout_p=p_drop, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.output_proj(output)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.w1 = nn.Linear(spec.hidden, spec.ffn, bias=spec.mlp_bias)
        self.w2 = nn.Linear(spec.ffn, spec.hidden, bias=spec.mlp_bias)
        self.w3 = nn.Linear(spec.hidden, spec.ffn, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.w1(x))
        h = h * self.w3(x)
        return self.w2(h)


class TransformerSelfAttentionLayer(nn.Module):
    """``h = attn(sa_norm(x)) + x; out = h + mlp(mlp_norm(h))`` (the scales are identities)."""

    def __init__(self, spec: ModelSpec, rope: RotaryPositionalEmbeddings) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(spec, rope)
        self.mlp = FeedForward(spec)
        self.sa_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.mlp_norm = RMSNorm(spec.hidden, spec.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.sa_norm(x)
        attn_out = self.attn(h, h)
        h = attn_out + x
        mlp_out = self.mlp(self.mlp_norm(h))
        return h + mlp_out


class TransformerDecoder(nn.Module):
    """torchtune's decoder: logits upcast to fp32, or ``num_output_chunks`` chunks."""

    def __init__(self, spec: ModelSpec, recompute: str = "none") -> None:
        super().__init__()
        if spec.model_type not in ("llama", "mistral", "qwen2") or spec.qk_norm:
            raise ValueError(f"model_type={spec.model_type!r}: the copy has torchtune's Llama")
        self.spec, self.recompute = spec, recompute
        self.num_output_chunks = 0
        self.tok_embeddings = nn.Embedding(spec.vocab, spec.hidden)
        rope = RotaryPositionalEmbeddings(
            spec.head_dim, spec.max_positions, spec.rope_theta or 10000.0
        )
        self.layers = nn.ModuleList(
            TransformerSelfAttentionLayer(spec, rope) for _ in range(spec.n_layers)
        )
        self.norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.output = None if spec.tied_embeddings else nn.Linear(spec.hidden, spec.vocab, False)
        self.head_hooks: contextlib.AbstractContextManager = contextlib.nullcontext()
        """``NoOpManager`` with activation offloading (the recipe's hooks on ``output``)."""

    def rope(self) -> RotaryPositionalEmbeddings:
        return self.layers[0].attn.pos_embeddings

    def set_num_output_chunks(self, chunks: int) -> None:
        self.num_output_chunks = chunks

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """``self.output`` (``TiedLinear``: the embedding's weight when tied)."""
        with self.head_hooks:
            if self.output is None:
                return F.linear(h, self.tok_embeddings.weight)
            return self.output(h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.recompute == "full" and self.training:
                h = checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        h = self.norm(h)
        if self.num_output_chunks > 0:
            return [self.head(c) for c in h.chunk(self.num_output_chunks, dim=1)]
        return self.head(h).float()


def build(spec: ModelSpec, job: Training, dtype: torch.dtype) -> TransformerDecoder:
    """The model in ``dtype`` with torchtune's fp32 RoPE buffers (torchtune builds under
    ``set_default_dtype``; its RoPE buffers are made ``.float()``)."""
    if job.recompute == "selective":
        raise ValueError("torchtune checkpoints whole layers: recompute='full' or 'none'")
    model = TransformerDecoder(spec, job.recompute)
    if dtype != torch.float32:
        model.to(dtype)
        rope = model.rope()
        del rope.theta, rope.cache
        rope.rope_init()
    if job.loss == "chunked-ce":
        model.set_num_output_chunks(job.loss_chunks)
    return model


def chunked_loss(logits: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """``CEWithChunkedOutputLoss.forward``: per chunk ``F.cross_entropy(chunk.float(), labels,
    reduction="sum")``, the sum divided by the number of counted labels."""
    total_elements = (labels != IGNORE_INDEX).sum()
    chunks = len(logits)
    pieces = [t.reshape(-1) for t in labels.chunk(chunks, dim=1)]
    flat = [c.reshape(-1, c.size(-1)) for c in logits]
    total_loss: torch.Tensor | float = 0.0
    for chunk, target in zip(flat, pieces, strict=True):
        total_loss += F.cross_entropy(
            chunk.float(), target, ignore_index=IGNORE_INDEX, reduction="sum"
        )
    return total_loss / total_elements


class RecipeLoss:
    """The recipe's ``_loss_step`` as the ``(ids, targets) -> loss`` of the training protocol."""

    def __init__(self, model: TransformerDecoder, job: Training) -> None:
        self.model, self.job = model, job
        self.ignore = torch.full((job.micro_batch, 1), IGNORE_INDEX, dtype=torch.long)
        """``ignore_labels_cache``, made at set-up (before the measured step)."""
        self.handling: contextlib.AbstractContextManager = contextlib.nullcontext()
        """``activations_handling_ctx`` (``get_act_offloading_ctx_manager``)."""
        if job.offload_activations:
            self.handling = offload.OffloadActivations()
            model.head_hooks = offload.NoOp()

    def __call__(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.handling:
            logits = self.model(ids)
        labels = torch.hstack((targets[..., 1:], self.ignore[: targets.shape[0]]))
        if isinstance(logits, list):
            loss = chunked_loss(logits, labels)
        else:
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
            loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
        del logits
        return loss
