"""The `reference` implementation: plain-PyTorch decoder models built from a `calc.ModelSpec`.

Textbook code, written so that every tensor it allocates can be named: an RMSNorm spelled out
as ``x * rsqrt(mean(x**2) + eps) * w``, RoPE with ``rotate_half``, SDPA (or an explicit eager
softmax attention), SwiGLU or GELU MLPs, a vocabulary head and ``F.cross_entropy``. One class
covers llama, mistral, qwen2, qwen3 (q/k norms) and gpt2 (LayerNorm, learned positions, fused
qkv, biases, tied head). `calc` models exactly the tensors this code saves; `verify` measures
them. Parameter order follows Hugging Face's ``named_parameters()`` for each family.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from calc.config.model_spec import ModelSpec


class RMSNorm(nn.Module):
    """Root-mean-square norm, decomposed into the ops it is made of (no fused kernel)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * rstd * self.weight


def _norm(spec: ModelSpec, size: int) -> nn.Module:
    if spec.norm == "layernorm":
        return nn.LayerNorm(size, eps=spec.norm_eps, bias=spec.norm_bias)
    return RMSNorm(size, spec.norm_eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the last dimension, as in the RoPE paper's real form."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with GQA, optional RoPE, q/k norms and biases."""

    def __init__(self, spec: ModelSpec, attention: str) -> None:
        super().__init__()
        self.spec = spec
        self.attention = attention
        self.selective = False
        h, a, kv, hd = spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim
        if spec.model_type == "gpt2":
            self.c_attn = nn.Linear(h, 3 * h, bias=spec.qkv_bias)
            self.c_proj = nn.Linear(h, h, bias=spec.o_bias)
        else:
            self.q_proj = nn.Linear(h, a * hd, bias=spec.qkv_bias)
            self.k_proj = nn.Linear(h, kv * hd, bias=spec.qkv_bias)
            self.v_proj = nn.Linear(h, kv * hd, bias=spec.qkv_bias)
            self.o_proj = nn.Linear(a * hd, h, bias=spec.o_bias)
            if spec.qk_norm:
                self.q_norm = RMSNorm(hd, spec.norm_eps)
                self.k_norm = RMSNorm(hd, spec.norm_eps)

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p_drop: float
    ) -> torch.Tensor:
        """The attention core (what selective recomputation checkpoints)."""
        if self.attention == "eager":
            return _eager_attention(q, k, v, p_drop)
        gqa = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=p_drop, is_causal=True, enable_gqa=gqa
        )

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of ``x`` as ``[b, heads, s, head_dim]`` views: projected (gpt2: one fused
        ``c_attn``), split into heads, q and k normed per head (``qk_norm``), before RoPE."""
        spec = self.spec
        bsz, seq, _ = x.shape
        a, kv, hd = spec.n_heads, spec.n_kv_heads, spec.head_dim
        if spec.model_type == "gpt2":
            q, k, v = self.c_attn(x).split(spec.hidden, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(bsz, seq, a, hd)
        k = k.view(bsz, seq, kv, hd)
        if spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.view(bsz, seq, kv, hd).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        spec = self.spec
        bsz, seq, _ = x.shape
        a, hd = spec.n_heads, spec.head_dim
        q, k, v = self.heads(x)
        if rope is not None:
            cos, sin = rope[0].to(q.dtype), rope[1].to(q.dtype)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        p_drop = spec.attention_dropout if self.training else 0.0
        if self.selective and self.training:
            out = checkpoint(self.core, q, k, v, p_drop, use_reentrant=False)
        else:
            out = self.core(q, k, v, p_drop)
        out = out.transpose(1, 2).reshape(bsz, seq, a * hd)
        proj = self.c_proj if spec.model_type == "gpt2" else self.o_proj
        return proj(out)


def _eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p_drop: float
) -> torch.Tensor:
    """Softmax attention spelled out: scores [b, a, s, s], causal mask, softmax, dropout."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    seq = q.shape[2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p_drop > 0:
        probs = F.dropout(probs, p_drop)
    return probs @ v


class MLP(nn.Module):
    """SwiGLU (gate, up, down) or GELU (fc, proj) feed-forward block."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        h, f = spec.hidden, spec.ffn
        if spec.mlp == "swiglu":
            self.gate_proj = nn.Linear(h, f, bias=spec.mlp_bias)
            self.up_proj = nn.Linear(h, f, bias=spec.mlp_bias)
            self.down_proj = nn.Linear(f, h, bias=spec.mlp_bias)
        else:
            self.c_fc = nn.Linear(h, f, bias=spec.mlp_bias)
            self.c_proj = nn.Linear(f, h, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.mlp == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)); dropout on each branch."""

    def __init__(self, spec: ModelSpec, attention: str) -> None:
        super().__init__()
        self.spec = spec
        if spec.model_type == "gpt2":
            self.ln_1 = _norm(spec, spec.hidden)
            self.attn = Attention(spec, attention)
            self.ln_2 = _norm(spec, spec.hidden)
            self.mlp = MLP(spec)
        else:
            self.self_attn = Attention(spec, attention)
            self.mlp = MLP(spec)
            self.input_layernorm = _norm(spec, spec.hidden)
            self.post_attention_layernorm = _norm(spec, spec.hidden)

    def _parts(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        if self.spec.model_type == "gpt2":
            return self.ln_1, self.attn, self.ln_2, self.mlp
        return self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        norm1, attn, norm2, mlp = self._parts()
        p = self.spec.hidden_dropout if self.training else 0.0
        x = x + _dropout(attn(norm1(x), rope), p)
        return x + _dropout(mlp(norm2(x)), p)


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    return F.dropout(x, p) if p > 0 else x


class ReferenceLM(nn.Module):
    """A decoder-only language model; ``forward(ids, targets)`` returns the mean CE loss.

    Args:
        spec: the model's dimensions and structure.
        attention: ``"sdpa"`` (``F.scaled_dot_product_attention``) or ``"eager"``.
        recompute: ``"none"``, ``"full"`` (checkpoint every layer) or ``"selective"``
            (checkpoint the attention core only), with non-reentrant ``torch.utils.checkpoint``.
    """

    def __init__(self, spec: ModelSpec, attention: str = "sdpa", recompute: str = "none") -> None:
        super().__init__()
        self.spec = spec
        self.recompute = recompute
        h = spec.hidden
        gpt2 = spec.model_type == "gpt2"
        if gpt2:
            self.wte = nn.Embedding(spec.vocab, h)
            self.wpe = nn.Embedding(spec.max_positions, h)
            self.h = nn.ModuleList(Block(spec, attention) for _ in range(spec.n_layers))
            self.ln_f = _norm(spec, h)
        else:
            self.embed_tokens = nn.Embedding(spec.vocab, h)
            self.layers = nn.ModuleList(Block(spec, attention) for _ in range(spec.n_layers))
            self.norm = _norm(spec, h)
        if not spec.tied_embeddings:
            self.lm_head = nn.Linear(h, spec.vocab, bias=False)
        if recompute == "selective":
            for block in self.blocks:
                block._parts()[1].selective = True
        if not gpt2:
            self.register_buffer("cos", torch.empty(0), persistent=False)
            self.register_buffer("sin", torch.empty(0), persistent=False)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.h if self.spec.model_type == "gpt2" else self.layers

    def set_rope(self, seq_len: int) -> None:
        """Precompute the RoPE tables [seq, head_dim] in the parameters' dtype (buffers, alive
        before the step). Call it after any ``model.to(dtype)``."""
        hd = self.spec.head_dim
        theta = self.spec.rope_theta or 10000.0
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
        emb = torch.cat((ang, ang), dim=-1)
        weight = self.embed_tokens.weight
        self.cos = emb.cos().to(device=weight.device, dtype=weight.dtype)
        self.sin = emb.sin().to(device=weight.device, dtype=weight.dtype)

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if spec.model_type == "gpt2":
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.wte(ids) + self.wpe(pos)
            rope = None
        else:
            x = self.embed_tokens(ids)
            rope = (self.cos, self.sin)
        x = _dropout(x, spec.embedding_dropout if self.training else 0.0)
        for block in self.blocks:
            if self.recompute == "full" and self.training:
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        final = self.ln_f if spec.model_type == "gpt2" else self.norm
        return final(x)

    def head_weight(self) -> torch.Tensor:
        if self.spec.tied_embeddings:
            emb = self.wte if self.spec.model_type == "gpt2" else self.embed_tokens
            return emb.weight
        return self.lm_head.weight

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.hidden_states(ids), self.head_weight())
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
