"""Hugging Face transformers 5.24 prefill into a ``StaticCache`` (llama, mistral, qwen2, qwen3).

What `verify.run.step.prefill` runs for ``implementation="hf"``, under ``torch.no_grad()``::

    cache = transformers.StaticCache(config=model.config, max_cache_len=context)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, cache=cache)
    del out, cache

replayed op by op with the training forward's pieces (`calc.models.hf`) and grad mode off
(``tape.grad_enabled = False``: no autograd node, nothing saved, every tensor dies with its last
Python reference). What differs from training's forward, read in ``cache_utils.py``,
``masking_utils.py``, ``integrations/sdpa_attention.py`` and ``modeling_<family>.py``:

* ``StaticCache.__init__``: one ``StaticLayer`` per layer (``StaticSlidingWindowLayer`` for a
  ``sliding_attention`` layer: mistral's ``sliding_window`` with no ``layer_types``), each making
  ``cumulative_length = torch.tensor(0, dtype=int)``, a 0-d int64 tensor on the CPU. Its storage
  is made outside Python dispatch (the allocation trace sees it only as ``lift_fresh``'s
  output); the CPU storage tracker first sees it as an op input and ignores it
  (``count_late=False``), so the CPU replay does not charge it;
* the cache tensors are allocated lazily, at the layer's first ``update``
  (``lazy_initialization``): ``zeros(b, kv_heads, max_cache_len, head_dim)`` for K then V, in
  the key's dtype (the model dtype), so layer ``j``'s cache appears inside layer ``j`` after its
  RoPE. ``max_cache_len`` is ``context`` (a sliding layer keeps ``min(window, context)``: only
  ``window > context`` is modelled). On CUDA, ``cumulative_length.to(device)`` then copies the
  CPU-made counter to the GPU (one 512-byte block); on CPU it is a no-op;
* ``update`` writes with ``index_copy_`` (in place) at ``cache_position = torch.arange(s) +
  cumulative_length`` (an int64 ``arange`` and the sum; the ``arange`` dies first, the sum when
  ``update`` returns) and returns the whole cache tensors; the RoPE'd keys and the projected
  values die then (their names are rebound);
* the mask: ``create_causal_mask`` / ``create_sliding_window_causal_mask`` return None for sdpa.
  The cache is not initialised when the mask is built, so ``get_seq_length`` is the int 0 (no
  tensor comparison); ``_ignore_causal_mask_sdpa`` skips on ``kv_length == q_length`` (prompt ==
  context) and otherwise on ``q_offset == 0``; a sliding window longer than ``kv_length`` adds
  nothing (``window <= context`` builds the mask: not modelled). So no mask for ``1 < prompt <=
  context``, both cases allocating the same (a one-token prompt builds one: not modelled);
* SDPA gets ``is_causal=True`` and the cache sliced to the prompt (``key[:, :, :q_length]``, a
  view: ``sdpa_attention_forward`` crops an empty static cache), GQA through ``enable_gqa``
  (head dim <= 256): exactly training's SDPA call (output, fp32 logsumexp freed at once);
* the head: ``slice_logits_to_keep(hidden, 1)`` is ``hidden[:, -1:, :]``, a view that
  ``F.linear`` folds to ``[b, h]`` without a copy: logits ``[b, V]`` in the model dtype, no
  ``.float()`` (no labels: no loss). The final norm runs over every position, and its output
  (``outputs.last_hidden_state``) dies when ``forward`` returns, before ``del out`` frees the
  logits; ``del cache`` then frees per layer K, V and the counter.

Before the replay: the weights, the prompt ids, and the rotary embedding's two buffers
``inv_freq`` and ``original_inv_freq`` (``[head_dim / 2]`` each, in the model dtype after
``model.to(dtype)``). Block outputs are tagged `calc.step.inference.RESIDUAL` (see the note there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from calc import symbols as S
from calc.config.compression import Quant
from calc.config.jobs import Inference
from calc.config.model_spec import ModelSpec
from calc.models import attention_core, hf, shape
from calc.models import reference as R
from calc.models.shape import shape_for_inference
from calc.replay import ops
from calc.replay.kinds import StorageKind
from calc.replay.tape import Event, Size, Tape, Tensor

INT64 = 8
RESIDUAL = "residual"
"""Tag of a block's output (`calc.step.inference.RESIDUAL`)."""

__all__ = ["numeric_shape", "replay", "replay_hf_prefill"]


def check(model: ModelSpec, job: Inference, sh: R.Shape) -> None:
    """Raise ``NotImplementedError`` for what this replay does not cover."""
    if model.model_type not in ("llama", "mistral", "qwen2", "qwen3", "gpt2"):
        raise NotImplementedError(
            f"implementation='hf' inference for {model.model_type} is not modelled yet; "
            "implementation='reference' (--implementation reference) models it"
        )
    if sh.attention not in ("flash", "efficient"):
        raise NotImplementedError(
            f"implementation='hf' inference with attention kernel {sh.attention!r} is not "
            "modelled yet; attention='sdpa' (flash or efficient) is"
        )
    if model.sliding_window is not None and model.sliding_window <= job.context:
        # StaticSlidingWindowLayer keeps min(window, context) tokens, and sdpa_mask builds the
        # sliding mask once kv_length >= window (measured: window == context builds it too)
        raise NotImplementedError(
            "implementation='hf' inference with a sliding window not longer than the context "
            "is not modelled yet; a context up to the window is, and implementation='reference' "
            "(--implementation reference: attention over the whole context, no window) is"
        )
    if job.prompt_len == 1:
        # a one-token forward over a compileable cache never skips the mask (decode's path:
        # sdpa_mask, pack_gqa, no cropping)
        raise NotImplementedError(
            "implementation='hf' inference of a one-token prompt is not modelled yet; "
            "implementation='reference' (--implementation reference) models it"
        )


def replay_hf_prefill(
    model: ModelSpec, job: Inference, device: str, n_layers: int, compress: Compress | None = None
) -> list[Event]:
    """Replay the HF prefill of ``job`` with ``n_layers`` concrete layers; sizes in the symbols
    ``b, s, c`` and the model's. ``compress``: as `replay`'s, for a job with ``quant``."""
    sh = shape_for_inference(model, job, device, n_layers)
    check(model, job, sh)
    if job.kv_quant is not None:
        raise NotImplementedError("a quantized KV cache with implementation='hf' is not modelled")
    return replay(sh, S.c, quant=job.quant, compute=job.precision, compress=compress)


def numeric_shape(model: ModelSpec, job: Inference, device: str) -> tuple[R.Shape, int]:
    """`calc.models.shape.numeric_shape` with this implementation's refusals."""
    return shape.numeric_shape(model, job, device, check)


class CacheLayer(Protocol):
    """A cache layer as the attention sees it: ``update`` returns the keys and values to attend."""

    def update(self, tape: Tape, sh: R.Shape, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


# -- StaticLayer ----------------------------------------------------------------------------------
class StaticLayer:
    """One ``StaticLayer`` (or ``StaticSlidingWindowLayer`` with ``window >= context``: the same
    allocations): the counter made at construction, K and V made at the first update."""

    def __init__(self, tape: Tape, j: int, context: Size, device: str) -> None:
        self.j = j
        self.context = context
        self.device = device
        # self.cumulative_length = torch.tensor(0, dtype=int): made on the CPU whatever the
        # device, by a constructor that bypasses Python dispatch; the CPU storage tracker
        # ignores such storages (``count_late=False``), so on both devices it is charged only
        # when ``lazy_initialization`` moves it to a CUDA device
        self.length: Tensor | None = None
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def update(self, tape: Tape, sh: R.Shape, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``StaticLayer.update(key_states, value_states)``: the cache tensors, written in place."""
        if self.keys is None:  # lazy_initialization
            numel = sh.b * sh.k * self.context * sh.d
            self.keys = tape.new(
                numel, k.itemsize, "k_cache", kind=StorageKind.KV_CACHE, tag=self.j
            )
            self.values = tape.new(
                numel, v.itemsize, "v_cache", kind=StorageKind.KV_CACHE, tag=self.j
            )
            if self.device == "cuda":  # cumulative_length.to(device): a GPU copy of the counter
                self.length = tape.new(
                    1, INT64, "cache.length", kind=StorageKind.KV_CACHE, tag=self.j
                )
        ar = ops.plain(tape, sh.s, INT64, "cache.arange")  # torch.arange(kv_length)
        pos = ops.plain(tape, sh.s, INT64, "cache.position")  # + self.cumulative_length
        tape.drop(ar)
        # cumulative_length.add_(kv_length); keys.index_copy_(2, pos, k); values.index_copy_(...)
        tape.drop(pos)
        assert self.keys is not None and self.values is not None
        return tape.alias(self.keys), tape.alias(self.values)

    def free(self, tape: Tape) -> None:
        """The layer object dies (``del cache``): keys, values, then the counter."""
        tape.drop(self.keys, self.values, self.length)


# -- attention / decoder layer --------------------------------------------------------------------
def attention(
    tape: Tape, sh: R.Shape, x: Tensor, lw: dict, cos: Tensor, sin: Tensor, layer: CacheLayer,
    mask_numel: Size | None = None,
) -> Tensor:  # fmt: skip
    """``LlamaAttention.forward`` (and mistral/qwen2/qwen3's) with a static cache, no grad.
    ``mask_numel``: a boolean mask of that many elements is passed (`sdpa_bool_mask`)."""
    n = sh.b * sh.s
    heads = []
    # query_states = self.q_proj(x).view(hidden_shape)[-> q_norm].transpose(1, 2), then k
    for key, nh in (("q", sh.a), ("k", sh.k)):
        lin = hf.linear(tape, x, lw[key], lw[f"{key}.b"], n, nh * sh.d, key)
        v1 = tape.alias(lin)
        tape.drop(lin)
        if sh.qk_norm:
            nv = hf.rmsnorm(tape, v1, lw[f"{key}_norm"], n * nh)
            tape.drop(v1)
            v1 = nv
        heads.append(v1)
    qt, kt = heads
    vt = hf.linear(tape, x, lw["v"], lw["v.b"], n, sh.k * sh.d, "v")
    # apply_rotary_pos_emb
    qr = hf.rope_one(tape, qt, cos, sin, "q")
    kr = hf.rope_one(tape, kt, cos, sin, "k")
    tape.drop(qt, kt)
    # key_states, value_states = cache.update(key_states, value_states, layer_idx)
    keys, values = layer.update(tape, sh, kr, vt)
    tape.drop(kr, vt)
    # sdpa_attention_forward: keys/values cropped to the prompt (views), is_causal=True
    mask = None if mask_numel is None else sdpa_bool_mask(tape, mask_numel, qr.itemsize)
    out = attention_core.core(tape, sh, qr, keys, values, "attn")
    tape.drop(mask)
    o = tape.alias(out)  # reshape/transpose/contiguous: views of the [b, s, a, d] output
    tape.drop(out)
    y = hf.linear(tape, o, lw["o"], lw["o.b"], n, sh.h, "o")
    tape.drop(o, qr, keys, values)
    return y


def sdpa_bool_mask(tape: Tape, numel: Size, itemsize: int) -> Tensor:
    """The CPU flash kernel takes a float mask: a boolean one becomes ``torch.where(mask, 0,
    -inf)`` in the query's dtype (two 0-d scalars, freed at once), alive through the kernel."""
    z = ops.plain(tape, 1, itemsize, "mask.zero")
    m = ops.plain(tape, 1, itemsize, "mask.min")
    w = ops.plain(tape, numel, itemsize, "mask.where")
    tape.drop(z, m)
    return w


def decoder_layer(
    tape: Tape, sh: R.Shape, x: Tensor, lw: dict, cos: Tensor, sin: Tensor, layer: CacheLayer,
    mask_numel: Size | None = None,
) -> Tensor:  # fmt: skip
    n = sh.b * sh.s
    n1 = hf.rmsnorm(tape, x, lw["norm1"], n)
    att = attention(tape, sh, n1, lw, cos, sin, layer, mask_numel)
    tape.drop(n1)
    x2 = ops.add_cast_in_formula(tape, x, att, "resid1")  # residual + hidden_states
    tape.drop(att)
    n2 = hf.rmsnorm(tape, x2, lw["norm2"], n)
    ff = hf.mlp(tape, sh, n2, lw)
    tape.drop(n2)
    x3 = ops.add_cast_in_formula(tape, x2, ff, "resid2")
    tape.drop(ff, x2)
    return x3


def prefill(tape: Tape, sh: R.Shape, w: R.Weights, layers: list[StaticLayer]) -> Tensor:
    """``XForCausalLM.forward(input_ids, cache=cache, use_cache=True, logits_to_keep=1)``;
    returns the logits ``[b, V]`` (the output object's only tensor besides the cache)."""
    n = sh.b * sh.s
    tape.segment = "embed"
    emb = ops.embedding(tape, w.embed, n, sh.h, "embed_out")  # embed_tokens(input_ids)
    # position_ids = torch.arange(s) + past_seen_tokens (the int 0), then unsqueeze(0) (a view)
    ar = ops.plain(tape, sh.s, INT64, "arange")
    pos = ops.plain(tape, sh.s, INT64, "position_ids")
    tape.drop(ar)
    # causal_mask: None (module docstring)
    cos, sin = hf.rotary(tape, sh, pos, emb.itemsize)
    x = tape.alias(emb)  # hidden_states = inputs_embeds
    for j, (lw, layer) in enumerate(zip(w.layers, layers, strict=True)):
        tape.segment = j
        x_next = decoder_layer(tape, sh, x, lw, cos, sin, layer)
        x_next.storage.tag = RESIDUAL
        tape.drop(x)
        x = x_next
    tape.segment = "head"
    hid = hf.rmsnorm(tape, x, w.norm, n)  # self.norm(hidden_states)
    tape.drop(x, emb, pos, cos, sin)  # LlamaModel.forward returns
    last = tape.alias(hid, numel=sh.b * sh.h)  # hidden_states[:, -1:, :]
    logits = hf.linear(tape, last, w.head, None, sh.b, sh.V, "logits")  # lm_head
    tape.drop(last, hid)  # LlamaForCausalLM.forward returns
    return logits


Compress = Callable[[Tape, R.Weights, R.Shape, None, Quant, str], object]
"""``compress(tape, weights, shape, lora=None, quant, compute)``: replaces the dense decoder
linears by their quantized form (`calc.compress.lora.compress_weights`, passed in by the
caller: compression sits above the model graphs)."""


def no_grad_tape(
    sh: R.Shape, quant: Quant | None, compute: str, compress: Compress | None
) -> tuple[Tape, R.Weights]:
    """A tape with grad mode off and the model's weights on it, the decoder linears quantized
    by ``compress`` when ``quant`` is given."""
    tape = Tape(inplace_accumulate=sh.device == "cuda")
    tape.grad_enabled = False
    w = R.Weights(tape, sh)
    if quant is not None:
        if compress is None:
            raise ValueError("quant needs compress (calc.compress.lora.compress_weights)")
        compress(tape, w, sh, None, quant, compute)
    return tape, w


def replay(
    sh: R.Shape,
    context: Size,
    quant: Quant | None = None,
    compute: str = "bf16",
    compress: Compress | None = None,
) -> list[Event]:
    """The replay itself, for symbolic or int sizes (``sh.s`` prompt, ``context`` cache);
    ``quant``: quantized decoder linears, applied by ``compress``."""
    tape, w = no_grad_tape(sh, quant, compute, compress)
    tape.existing(sh.b * sh.s, INT64, "input_ids", StorageKind.INPUT)
    half = sh.d // 2 if isinstance(sh.d, int) else sh.d / 2
    tape.existing(half, sh.weight_itemsize, "rotary.inv_freq", StorageKind.BUFFER)
    tape.existing(half, sh.weight_itemsize, "rotary.original_inv_freq", StorageKind.BUFFER)
    tape.phase = "prefill"
    layers = []
    for j in range(sh.n_layers):  # StaticCache(config, max_cache_len=context)
        tape.segment = j
        layers.append(StaticLayer(tape, j, context, sh.device))
    logits = prefill(tape, sh, w, layers)
    tape.drop(logits)  # del out
    tape.segment = "head"
    for layer in layers:  # del cache
        layer.free(tape)
    return tape.events
