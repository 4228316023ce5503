"""LitGPT's LoRA fine-tuning (``implementation="litgpt"`` with ``lora``): a faithful small copy
of litgpt 0.5.12's adapter layers (``litgpt/lora.py``) on `verify.models.litgpt_llama`'s Llama,
and of the loop of ``litgpt/finetune/lora.py``. ``tests/verify/models/test_litgpt_lora.py``
compares it with litgpt itself, through Fabric's wrapper, wherever litgpt imports.

* ``LoRALinear`` (lines 89-172): the frozen ``linear`` and, for ``r > 0``, ``lora_A [r, in]``
  and ``lora_B [out, r]``, registered on the module itself, so ``parameters()`` yields them
  before ``linear.weight``; ``pretrained = linear(x)``, ``lora = (dropout(x) @ A.T @ B.T) *
  scaling``, ``pretrained + lora``. The head, ``attn.proj`` and the MLP's three are these
  (``create_lora_linear``: ``r`` only where ``lora_head``, ``lora_projection``, ``lora_mlp``).
* ``LoRAQKVLinear`` (lines 175-410): the fused ``qkv`` with one ``lora_A [r E, in]`` and one
  ``lora_B [sum of the enabled parts, r]`` (``E`` enabled of q, k, v); ``after_A =
  F.linear(dropout(x), lora_A)``; ``conv1d`` on ``after_A.transpose(-2, -1)`` with
  ``lora_B.unsqueeze(-1)`` (one grouped ``F.conv1d`` when ``n_head == n_query_groups``, else
  one per part of ``input.chunk(E, 1)`` and ``weight.split``, concatenated); ``zero_pad``:
  the update itself when q, k and v are all enabled, else ``new_zeros`` of the output width
  and ``index_copy_`` at ``lora_ind`` (a buffer made by ``torch.tensor`` in the first
  forward); ``* scaling``; ``pretrained + lora``.
* ``mark_only_lora_as_trainable`` (lines 413-443): only ``lora_*`` train.
* the loop (``finetune/lora.py`` ``fit``, lines 352-356): ``logits = model(input_ids,
  lm_head_chunk_size=128)``, the head on 128-token slices of the last hidden state (a list,
  every chunk cast to fp32 by Fabric's ``bf16-true`` wrapper); ``logits[-1] =
  logits[-1][..., :-1, :]``; ``chunked_cross_entropy(logits, targets[..., 1:])`` on the list
  (``litgpt/utils.py`` lines 319-337: each chunk reshaped to rows, the targets split by the
  first chunk's length, ``cross_entropy(..., reduction="none")`` per chunk); ``fabric.backward
  (loss / accumulation)``; the list and the loss live until the next iteration.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from calc.derive.quantized import quant_linear_class
from calc.models.litgpt_arch import arch_of
from verify.models import litgpt_llama

if TYPE_CHECKING:
    from calc.config.compression import LoRA, Quant
    from calc.config.jobs import Training
    from calc.config.model_spec import ModelSpec

HEAD_CHUNK_TOKENS = 128
"""``finetune/lora.py``'s ``lm_head_chunk_size``."""


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class LoRALinear(nn.Module):
    """litgpt's ``LoRALinear`` (its ``linear`` with a bias where the configuration has one)."""

    def __init__(
        self, in_f: int, out_f: int, r: int, alpha: float, dropout: float, bias: bool = False
    ) -> None:
        super().__init__()
        self.r = r
        self.lora_dropout: Any = nn.Dropout(p=dropout) if dropout > 0.0 else _identity
        self.linear = nn.Linear(in_f, out_f, bias=bias)
        if r > 0:
            self.lora_A = nn.Parameter(torch.empty((r, in_f)))
            self.lora_B = nn.Parameter(torch.empty((out_f, r)))
            self.scaling = alpha / r
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pretrained = self.linear(x)
        if self.r == 0:
            return pretrained
        lora = (
            self.lora_dropout(x) @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)
        ) * self.scaling
        return pretrained + lora


class LoRAQKVLinear(nn.Module):
    """litgpt's ``LoRAQKVLinear`` on the fused ``qkv`` projection."""

    def __init__(
        self, in_f: int, head_size: int, n_head: int, n_query_groups: int, r: int,
        alpha: float, dropout: float, enable_lora: tuple[bool, bool, bool], bias: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.r = r
        self.lora_dropout: Any = nn.Dropout(p=dropout) if dropout > 0.0 else _identity
        out_f = (n_head + 2 * n_query_groups) * head_size
        self.linear = nn.Linear(in_f, out_f, bias=bias)
        self.head_size, self.n_head, self.n_query_groups = head_size, n_head, n_query_groups
        self.enable_lora = list(enable_lora)
        if r > 0 and any(enable_lora):
            self.lora_A = nn.Parameter(torch.empty((r * sum(enable_lora), in_f)))
            q, k, v = enable_lora
            shapes = (head_size * n_head * q, head_size * n_query_groups * k,
                      head_size * n_query_groups * v)  # fmt: skip
            self.qkv_shapes = [s for s in shapes if s]
            self.lora_B = nn.Parameter(torch.empty(sum(self.qkv_shapes), r))
            self.scaling = alpha / r
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B)

    @property
    def lora_ind(self) -> torch.Tensor:
        """The output columns the enabled parts fill, a buffer made at the first use."""
        if not hasattr(self, "_lora_ind"):
            q, k, v = self.enable_lora
            kv_embd_size = self.linear.in_features // (self.n_head // self.n_query_groups)
            ind: list[int] = []
            if q:
                ind.extend(range(0, self.linear.in_features))
            if k:
                ind.extend(range(self.linear.in_features, self.linear.in_features + kv_embd_size))
            if v:
                ind.extend(range(self.linear.in_features + kv_embd_size, self.linear.out_features))
            self.register_buffer(
                "_lora_ind", torch.tensor(ind, device=self.lora_A.device), persistent=False
            )  # litgpt: the base weight's device (a quantized base has its own: the same one)
        return self._lora_ind

    def zero_pad(self, x: torch.Tensor) -> torch.Tensor:
        if all(self.enable_lora):
            return x
        result = x.new_zeros(*x.shape[:-1], self.linear.out_features)
        return result.index_copy_(dim=-1, index=self.lora_ind, source=x)

    def conv1d(self, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.n_head == self.n_query_groups:
            return F.conv1d(input, weight, groups=sum(self.enable_lora))
        input_splitted = input.chunk(sum(self.enable_lora), dim=1)
        weight_splitted = weight.split(self.qkv_shapes)
        return torch.cat(
            [F.conv1d(a, b) for a, b in zip(input_splitted, weight_splitted, strict=True)], dim=1
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pretrained = self.linear(x)
        if self.r == 0 or not any(self.enable_lora):
            return pretrained
        after_A = F.linear(self.lora_dropout(x), self.lora_A)
        after_B = self.conv1d(after_A.transpose(-2, -1), self.lora_B.unsqueeze(-1)).transpose(
            -2, -1
        )
        lora = self.zero_pad(after_B) * self.scaling
        return pretrained + lora


class StableEmbedding(nn.Embedding):
    """bitsandbytes' ``StableEmbedding`` (``bitsandbytes/nn/modules.py``), which
    ``finetune/lora.py`` (lines 217-228) puts in place of ``wte`` under ``--quantize``: an
    embedding and a ``LayerNorm``; ``forward`` looks the rows up, casts them to
    ``torch.get_default_dtype()`` ("always apply layer norm in full precision"), normalizes
    and casts back to the weight's dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.norm = nn.LayerNorm(embedding_dim)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        emb = F.embedding(input, self.weight)
        emb = emb.to(torch.get_default_dtype())
        return self.norm(emb).to(self.weight.dtype)


def quantize(model: litgpt_llama.GPT, quant: Quant) -> None:
    """``--quantize bnb.nf4`` (``bnb.nf4-dq`` with ``double_quant``): Lightning's
    ``BitsandbytesPrecision`` builds every ``nn.Linear`` as bitsandbytes' ``Linear4bit``
    (the head too); here each is calc's ``QuantLinear`` (``calc.derive.quantized``, the
    dequantizing matmul verify runs on the CPU in place of bitsandbytes' kernels). Then, after
    the optimizer would be built, ``StableEmbedding`` replaces ``wte`` in the model's dtype:
    trainable, outside the optimizer (``stepped`` leaves it out); the old ``wte`` stays alive
    (litgpt's ``old_embedding`` and the optimizer's parameter list hold it)."""
    cls = quant_linear_class()
    holders: list[Any] = [model.lm_head]
    for block in model.transformer.h:
        mlp = block.mlp
        pair = [mlp.fc] if hasattr(mlp, "fc") else [mlp.fc_1, mlp.fc_2]  # GptNeoxMLP: fc
        holders += [block.attn.qkv, block.attn.proj, *pair, mlp.proj]
    for holder in holders:
        holder.linear = cls(holder.linear, quant)
    old = model.transformer.wte
    stable = StableEmbedding(old.num_embeddings, old.embedding_dim)
    with torch.no_grad():
        stable.weight.copy_(old.weight)
    model.transformer.wte = stable.to(dtype=old.weight.dtype)
    model.old_embedding = [old]  # a list: not registered as a submodule
    for p in model.transformer.wte.parameters():
        p.unstepped = True  # type: ignore[attr-defined]


def stepped(model: nn.Module) -> list[torch.Tensor]:
    """The parameters the optimizer steps: those with ``requires_grad``, but QLoRA's
    ``StableEmbedding`` (made after the optimizer)."""
    return [p for p in model.parameters() if p.requires_grad and not getattr(p, "unstepped", False)]


def flags(lora: LoRA) -> dict[str, bool]:
    """litgpt's ``lora_query``, ``lora_key``, ``lora_value``, ``lora_projection`` and
    ``lora_mlp`` for ``lora.modules`` (``gate``, ``up`` and ``down`` are one flag)."""
    mods = set(lora.modules)
    mlp = {"gate", "up", "down"} & mods
    if mlp and len(mlp) != 3:
        raise ValueError(f"modules={lora.modules!r}: litgpt adapts the MLP's three or none")
    return {"query": "q" in mods, "key": "k" in mods, "value": "v" in mods,
            "projection": "o" in mods, "mlp": bool(mlp), "head": "lm_head" in mods}  # fmt: skip


def build(spec: ModelSpec, job: Training, dtype: torch.dtype) -> litgpt_llama.GPT:
    """``finetune/lora.py``'s model: litgpt's Llama with the LoRA layers (``lora_head`` for
    ``lm_head`` in the modules), only ``lora_*`` trainable, in ``dtype``, ``max_seq_length`` at the training
    length."""
    lora = job.lora
    assert lora is not None
    if job.recompute != "none":
        raise ValueError("litgpt's single-device fine-tuning checkpoints nothing")
    on = flags(lora)
    r, alpha, p = lora.rank, lora.rank if lora.alpha is None else lora.alpha, lora.dropout

    def linear(in_f: int, out_f: int, use_r: bool, bias: bool) -> LoRALinear:
        return LoRALinear(in_f, out_f, r if use_r else 0, alpha, p, bias)

    model = litgpt_llama.GPT(spec)
    h, f, d, a, b = spec.hidden, spec.ffn, spec.head_dim, spec.n_heads, spec.mlp_bias
    model.lm_head = linear(h, spec.vocab, on["head"], arch_of(spec).head_bias)
    for block in model.transformer.h:
        enable = (on["query"], on["key"], on["value"])
        qkv_bias = spec.qkv_bias  # bias or attn_bias (Qwen2.5: the qkv alone)
        block.attn.qkv = LoRAQKVLinear(h, d, a, spec.n_kv_heads, r, alpha, p, enable, qkv_bias)
        block.attn.proj = linear(a * d, h, on["projection"], spec.o_bias)
        if spec.mlp == "gelu":  # litgpt/lora.py's GptNeoxMLP: fc and proj
            block.mlp.fc = linear(h, f, on["mlp"], b)
            block.mlp.proj = linear(f, h, on["mlp"], b)
            continue
        block.mlp.fc_1 = linear(h, f, on["mlp"], b)
        block.mlp.fc_2 = linear(h, f, on["mlp"], b)
        block.mlp.proj = linear(f, h, on["mlp"], b)
    for name, param in model.named_parameters():  # mark_only_lora_as_trainable
        param.requires_grad = "lora_" in name
    if dtype != torch.float32:
        model.to(dtype)
    if job.quant is not None:
        quantize(model, job.quant)
    model.set_max_seq_length(job.seq_len)
    return model


def chunked_cross_entropy(logits: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """``litgpt.utils.chunked_cross_entropy`` on a list of logits chunks (chunk size 128)."""
    logit_chunks = [chunk.reshape(-1, chunk.size(-1)) for chunk in logits]
    target_chunks = [t.reshape(-1) for t in targets.split(logits[0].size(1), dim=1)]
    loss_chunks = [
        F.cross_entropy(lc, tc, ignore_index=litgpt_llama.IGNORE_INDEX, reduction="none")
        for lc, tc in zip(logit_chunks, target_chunks)  # noqa: B905 (litgpt's zip)
    ]
    non_masked_elems = (targets != litgpt_llama.IGNORE_INDEX).sum()
    return torch.cat(loss_chunks).sum() / non_masked_elems.maximum(
        torch.ones_like(non_masked_elems)
    )


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Lightning's ``_DtypeContextManager``: ``torch.set_default_dtype`` for the block."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class LoRAFineTuneLoss:
    """``finetune/lora.py``'s step as the ``(ids, targets) -> loss`` of the training protocol:
    the chunked head through Fabric's wrapper, the last chunk's last position sliced off, the
    list of chunks and the loss kept until the next micro-batch replaces them, the loss
    divided by the accumulation count."""

    def __init__(self, model: nn.Module, accumulation: int) -> None:
        self.model = model
        self.accumulation = accumulation
        self.dtype = model.transformer.ln_f.weight.dtype
        self.half = self.dtype != torch.float32  # Fabric's HalfPrecision (or bitsandbytes')
        self.logits: list[torch.Tensor] | None = None
        self.loss: torch.Tensor | None = None

    def __call__(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with _default_dtype(self.dtype):  # BitsandbytesPrecision.forward_context (bf16-true's
            out = self.model(ids, lm_head_chunk_size=HEAD_CHUNK_TOKENS)  # changes nothing)
        logits = litgpt_llama.fabric_output(out, self.half)
        del out
        self.logits = logits  # the previous list released as the name is rebound
        logits[-1] = logits[-1][..., :-1, :]
        self.loss = chunked_cross_entropy(logits, targets[..., 1:])
        return self.loss / self.accumulation
