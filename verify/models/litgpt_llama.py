"""LitGPT's Llama (``implementation="litgpt"``): a faithful small copy of its model code and of
its full fine-tuning loop, litgpt 0.5.12.

litgpt installs from the package index, but importing ``litgpt.model`` runs its package's
``__init__``, which imports Lightning and its logging stack; verify runs this copy, and
``tests/verify/models/test_litgpt_llama.py`` compares it with litgpt itself (same weights: same
loss and gradients, same bytes on the CPU tracker) wherever litgpt imports. Every op that
decides memory follows litgpt 0.5.12 (``litgpt/model.py`` unless named), for its Llama
configurations (``RMSNorm``, ``LLaMAMLP``, no biases, ``parallel_residual=False``,
``rotary_percentage=1``):

* parameters in registration order: ``lm_head`` first, then ``transformer.wte``, per block
  ``norm_1``, ``attn.qkv`` (one fused projection, ``(n_head + 2 n_query_groups) x head_size``
  rows), ``attn.proj``, ``norm_2``, ``mlp.fc_1``, ``mlp.fc_2``, ``mlp.proj``, then
  ``transformer.ln_f`` (``GPT.__init__``, ``Block.__init__``);
* ``RMSNorm.forward``: ``x.float()``, ``mean(x * x, -1, keepdim=True)``, ``x * rsqrt(norm_x +
  eps)``, ``* weight.float()``, ``.to(dtype)`` (lines 1119-1126);
* ``CausalSelfAttention.forward`` (lines 374-514): ``qkv`` split into views, ``view``,
  ``transpose(1, 2)``; ``apply_rope`` on ``q[..., :rope_n_elem]`` and ``k[...]`` (lines
  997-1026: the halves, ``cat((-x2, x1))``, ``x * cos + rotated * sin`` with the fp32 tables,
  ``.to(x.dtype)``), then ``cat((q_roped, q[..., rope_n_elem:]))`` (an empty second part: a
  copy); ``repeat_interleave`` of k and v for grouped queries; SDPA with ``is_causal=True``, or,
  where the configuration has a ``sliding_window_size`` (Mistral-7B-v0.1, Phi-3), with the
  additive mask every block builds (`sliding_window_mask`);
  ``y.transpose(1, 2)``, ``reshape``, ``proj``. The locals ``qkv``, ``q_roped`` and ``k_roped``
  live until the method returns;
* ``Block.forward``: ``x = attn(norm_1(x)) + x``, ``mlp(norm_2(x)) + x``; ``LLaMAMLP``:
  ``proj(silu(fc_1(x)) * fc_2(x))``;
* ``GPT.forward``: ``wte``, the blocks on ``cos[:T].unsqueeze(0)`` and ``sin[...]``, ``ln_f``,
  ``lm_head`` (the logits, whole: ``lm_head_chunk_size=0``);
* the RoPE tables: ``cos`` and ``sin`` [max_seq_length, rope_n_elem] buffers. Fabric's
  ``bf16-true`` converts the model, buffers included, to bf16; the fine-tuning script then sets
  ``model.max_seq_length`` to the longest training sequence, whose setter rebuilds the tables in
  fp32 (``build_rope_cache``) when that differs from ``block_size`` (lines 44-64);
* the fine-tuning loop (``litgpt/finetune/full.py`` ``fit``, lines 280-291):
  ``logits = model(input_ids)``, ``loss = chunked_cross_entropy(logits[..., :-1, :],
  targets[..., 1:])`` (``litgpt/utils.py`` lines 308-356: reshaped to rows, split in chunks
  of 128 rows, ``cross_entropy(..., reduction="none")`` per chunk, concatenated, summed and
  divided by the count of unmasked targets), ``fabric.backward(loss / accumulation)``. The
  loop's ``logits`` and ``loss`` live until the next iteration replaces them;
* the model is called through Fabric's wrapper (``fabric.setup_module``; lightning 2.5
  ``fabric/wrappers.py`` ``_FabricModule.forward``): with ``bf16-true``, ``HalfPrecision
  .convert_output`` (``fabric/plugins/precision/half.py``) casts every floating output to the
  default dtype, float32, so the loop holds fp32 logits and its loss runs in fp32 (`fabric_output`);
  ``32-true`` (the base ``Precision``) returns the output as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from calc.models.litgpt_arch import arch_of

if TYPE_CHECKING:
    from calc.config.jobs import Training
    from calc.config.model_spec import ModelSpec

IGNORE_INDEX = -100
"""``chunked_cross_entropy``'s ``ignore_index``."""
CE_CHUNK_ROWS = 128
"""``chunked_cross_entropy``'s default ``chunk_size``."""


class RMSNorm(nn.Module):
    """litgpt's ``RMSNorm``: computed in fp32, cast back to the input's dtype."""

    def __init__(self, size: int, eps: float, add_unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.add_unit_offset = add_unit_offset  # Gemma's (lines 1112-1126)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        norm_x = torch.mean(x * x, dim=-1, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        weight = (1 + self.weight) if self.add_unit_offset else self.weight
        return (x_normed * weight.float()).to(dtype=dtype)


def rope_tables(seq_len: int, n_elem: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``build_rope_cache``: fp32 ``cos``, ``sin`` [seq_len, n_elem] (the Llama 3.1 frequency
    adjustment changes values, not sizes: left out)."""
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2).float() / n_elem))
    seq_idx = torch.arange(seq_len).float()
    idx_theta = torch.outer(seq_idx, theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` on ``[B, heads, T, head_size]`` with ``[1, T, head_size]`` tables."""
    half = x.size(-1) // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    cos = cos.view(cos.shape[0], 1, *cos.shape[1:])  # the heads' dimension
    sin = sin.view(sin.shape[0], 1, *sin.shape[1:])
    roped = (x * cos) + (rotated * sin)
    return roped.to(dtype=x.dtype)


def norm_layer(spec: ModelSpec) -> nn.Module:
    """The configuration's ``norm_class``: litgpt's `RMSNorm` or ``torch.nn.LayerNorm``."""
    if spec.norm == "layernorm":
        return nn.LayerNorm(spec.hidden, eps=spec.norm_eps)
    return RMSNorm(spec.hidden, spec.norm_eps, add_unit_offset=arch_of(spec).gemma)


def rope_n_elem(spec: ModelSpec) -> int:
    """``int(rotary_percentage * head_size)``."""
    return int(arch_of(spec).rope_fraction * spec.head_dim)


class CausalSelfAttention(nn.Module):
    """litgpt's attention with the fused ``qkv`` projection."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.n_head, self.n_groups, self.head_size = spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.window = spec.sliding_window
        self.rope_n_elem = rope_n_elem(spec)
        rows = (self.n_head + 2 * self.n_groups) * self.head_size
        self.qkv = nn.Linear(spec.hidden, rows, bias=spec.qkv_bias)
        self.proj = nn.Linear(self.head_size * self.n_head, spec.hidden, bias=spec.o_bias)
        # norm_qk (Qwen3; norm_qk_type "default"): an RMSNorm of head_size on each head of q
        # and of k, registered after proj (litgpt/model.py lines 361-369)
        self.norm_q = RMSNorm(self.head_size, spec.norm_eps) if spec.qk_norm else None
        self.norm_k = RMSNorm(self.head_size, spec.norm_eps) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        hs, nh, ng = self.head_size, self.n_head, self.n_groups
        qkv = self.qkv(x)
        q, k, v = qkv.split((nh * hs, ng * hs, ng * hs), dim=-1)
        q = q.view(B, T, nh, hs).transpose(1, 2)
        k = k.view(B, T, ng, hs).transpose(1, 2)
        v = v.view(B, T, ng, hs).transpose(1, 2)
        if self.norm_q is not None and self.norm_k is not None:  # lines 445-447
            q = self.norm_q(q)
            k = self.norm_k(k)
        n = self.rope_n_elem
        q_roped = apply_rope(q[..., :n], cos, sin)
        k_roped = apply_rope(k[..., :n], cos, sin)
        q = torch.cat((q_roped, q[..., n:]), dim=-1)
        k = torch.cat((k_roped, k[..., n:]), dim=-1)
        if ng != nh:
            k = k.repeat_interleave(nh // ng, dim=1)
            v = v.repeat_interleave(nh // ng, dim=1)
        mask = None if self.window is None else sliding_window_mask(T, self.window, q.dtype)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, scale=hs**-0.5, is_causal=mask is None
        )
        y = y.transpose(1, 2).reshape(B, T, hs * nh)
        return self.proj(y)


def sliding_window_mask(T: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask ``CausalSelfAttention.forward`` builds in every block of a
    configuration with ``sliding_window_size`` (lines 481-503, training: no ``input_pos``):
    the causal mask (``ones(T, T)`` in q's dtype, ``triu(diagonal=1)``, ``-inf`` filled where
    ``mask.bool()``), then a ``full((T, T), -inf)`` whose row ``i`` is zeroed on
    ``[max(0, i - window + 1), i]`` one slice assignment at a time, which replaces it."""
    mask = torch.ones(T, T, dtype=dtype).triu(diagonal=1)
    mask.masked_fill_(mask.bool(), float("-inf"))
    mask = mask.view(1, 1, *mask.shape)
    window_mask = torch.full((T, T), float("-inf"), dtype=dtype)
    for i in range(T):
        window_mask[i, max(0, i - window + 1) : i + 1] = 0.0
    return window_mask.view(1, 1, T, T)


class LLaMAMLP(nn.Module):
    """``proj(silu(fc_1(x)) * fc_2(x))``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(spec.hidden, spec.ffn, bias=spec.mlp_bias)
        self.fc_2 = nn.Linear(spec.hidden, spec.ffn, bias=spec.mlp_bias)
        self.proj = nn.Linear(spec.ffn, spec.hidden, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fc_1 = self.fc_1(x)
        x_fc_2 = self.fc_2(x)
        x = F.silu(x_fc_1) * x_fc_2
        return self.proj(x)


class GemmaMLP(LLaMAMLP):
    """``proj(gelu(fc_1(x), approximate="tanh") * fc_2(x))`` (lines 755-760)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fc_1 = self.fc_1(x)
        x_fc_2 = self.fc_2(x)
        x = F.gelu(x_fc_1, approximate="tanh") * x_fc_2
        return self.proj(x)


class GptNeoxMLP(nn.Module):
    """``proj(gelu(fc(x), approximate=...))``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.fc = nn.Linear(spec.hidden, spec.ffn, bias=spec.mlp_bias)
        self.proj = nn.Linear(spec.ffn, spec.hidden, bias=spec.mlp_bias)
        self.approximate = arch_of(spec).gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        x = F.gelu(x, approximate=self.approximate)
        return self.proj(x)


class Block(nn.Module):
    """``x = attn(norm_1(x)) + x; return mlp(norm_2(x)) + x``, or the parallel residual:
    ``x_normed = norm_2(x)`` (``norm_1``'s output when shared), ``x = attn(...) + x``,
    ``mlp(x_normed) + x`` (lines 321-342)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        arch = arch_of(spec)
        self.parallel, self.shared = arch.parallel_residual, arch.shared_attention_norm
        self.norm_1 = norm_layer(spec)
        self.attn = CausalSelfAttention(spec)
        self.norm_2 = None if self.shared else norm_layer(spec)
        gemma = GemmaMLP(spec) if arch.gemma else LLaMAMLP(spec)
        self.mlp = GptNeoxMLP(spec) if spec.mlp == "gelu" else gemma

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x_normed = self.norm_1(x)
        attention_output = self.attn(x_normed, cos, sin)
        if self.parallel:
            if not self.shared:
                assert self.norm_2 is not None
                x_normed = self.norm_2(x)
            x = attention_output + x
        else:
            x = attention_output + x
            assert self.norm_2 is not None
            x_normed = self.norm_2(x)
        return self.mlp(x_normed) + x


class GPT(nn.Module):
    """litgpt's ``GPT`` for a Llama configuration: returns the logits."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if spec.model_type not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"model_type={spec.model_type!r}: the copy has litgpt's Llama")
        if spec.tied_embeddings:
            raise ValueError("litgpt's configurations have an untied head")
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=arch_of(spec).head_bias)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(spec.vocab, spec.hidden),
                "h": nn.ModuleList(Block(spec) for _ in range(spec.n_layers)),
                "ln_f": norm_layer(spec),
            }
        )
        self.block_size = spec.max_positions
        self.n_elem = rope_n_elem(spec)
        self.scale_embeddings, self.n_embd = arch_of(spec).gemma, spec.hidden
        self.rope_base = spec.rope_theta or 10000.0
        cos, sin = rope_tables(self.block_size, self.n_elem, self.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def set_max_seq_length(self, value: int) -> None:
        """The ``max_seq_length`` setter: new fp32 tables when the length changes."""
        if value > self.block_size:
            raise ValueError(f"max_seq_length={value} exceeds block_size={self.block_size}")
        if value != self.cos.size(0):
            self.cos, self.sin = rope_tables(value, self.n_elem, self.rope_base)

    def forward(
        self, idx: torch.Tensor, lm_head_chunk_size: int = 0
    ) -> torch.Tensor | list[torch.Tensor]:
        T = idx.size(1)
        cos = self.cos[:T].unsqueeze(0)
        sin = self.sin[:T].unsqueeze(0)
        x = self.transformer.wte(idx)
        if self.scale_embeddings:  # Gemma (lines 155-156)
            x = x * torch.tensor(self.n_embd**0.5, dtype=x.dtype)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        x = self.transformer.ln_f(x)
        if lm_head_chunk_size > 0:  # lines 177-179: the head on 128-token slices (LoRA's loop)
            return [self.lm_head(x_i) for x_i in x.split(lm_head_chunk_size, dim=1)]
        return self.lm_head(x)


def checkpoint_blocks(module: nn.Module) -> None:
    """``FSDPStrategy(activation_checkpointing_policy={Block})`` (``finetune/full.py`` on
    several devices): Lightning's ``_setup_activation_checkpointing`` (lightning 2.5,
    ``fabric/strategies/fsdp.py``) wraps every `Block` in torch's ``checkpoint_wrapper``
    (non-reentrant ``torch.utils.checkpoint`` since torch 2.2), after FSDP wrapped the model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    apply_activation_checkpointing(
        module, checkpoint_wrapper_fn=checkpoint_wrapper, auto_wrap_policy=ModuleWrapPolicy({Block})
    )


def build(spec: ModelSpec, job: Training, dtype: torch.dtype) -> GPT:
    """The model as ``finetune/full.py`` sets it up: built, converted to ``dtype`` (Fabric's
    ``bf16-true`` or ``32-true``: the buffers too), then ``max_seq_length`` set to the
    training sequence length. ``recompute="full"``: each block checkpointed (`checkpoint_blocks`;
    the FSDP engine builds without and checkpoints after wrapping, as Lightning does)."""
    model = GPT(spec)
    if job.recompute == "full":
        checkpoint_blocks(model)
    elif job.recompute != "none":
        raise ValueError(f"recompute={job.recompute!r}: litgpt checkpoints whole blocks")
    if dtype != torch.float32:
        model.to(dtype)
    model.set_max_seq_length(job.seq_len)
    return model


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``litgpt.utils.chunked_cross_entropy`` on a logits tensor (not a list), chunk 128."""
    logits = logits.reshape(-1, logits.size(-1))
    targets = targets.reshape(-1)
    loss_chunks = [
        F.cross_entropy(lc, tc, ignore_index=IGNORE_INDEX, reduction="none")
        for lc, tc in zip(logits.split(CE_CHUNK_ROWS), targets.split(CE_CHUNK_ROWS), strict=True)
    ]
    non_masked_elems = (targets != IGNORE_INDEX).sum()
    return torch.cat(loss_chunks).sum() / non_masked_elems.maximum(
        torch.ones_like(non_masked_elems)
    )


def fabric_output(output: Any, half: bool) -> Any:
    """``_FabricModule.forward``'s ``precision.convert_output(output)``: under ``bf16-true``
    (``half``) every floating tensor of the output (a list's too, all converted before the
    wrapper rebinds ``output`` and the bf16 ones are released) cast to
    ``torch.get_default_dtype()``, float32; else the output itself."""
    if not half:
        return output
    if isinstance(output, list):
        return [fabric_output(t, half) for t in output]
    if torch.is_floating_point(output):
        return output.to(torch.get_default_dtype())
    return output


class FineTuneLoss:
    """``finetune/full.py``'s step as the ``(ids, targets) -> loss`` of the training protocol:
    the model called through Fabric's wrapper (`fabric_output`), the logits and the loss kept
    until the next micro-batch replaces them, the loss divided by the accumulation count
    (``fabric.backward(loss / ...)``)."""

    def __init__(self, model: nn.Module, accumulation: int) -> None:
        self.model = model
        self.accumulation = accumulation
        self.half = next(model.parameters()).dtype != torch.float32  # Fabric's HalfPrecision
        self.logits: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None

    def __call__(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.logits = fabric_output(self.model(ids), self.half)
        self.loss = chunked_cross_entropy(self.logits[..., :-1, :], targets[..., 1:])
        return self.loss / self.accumulation
