"""Hugging Face transformers 5.24 ``generate`` (greedy, ``DynamicCache`` or a static cache) for
llama, mistral, qwen2, qwen3 and GPT-2: the prefill and every decode step, op by
op.

What `verify.run.step.generate` runs under ``torch.no_grad()``::

    out = model.generate(ids, max_new_tokens=n, do_sample=False)  # no attention mask passed

read in ``generation/utils.py`` (``generate``, ``_sample`` from line 3123,
``prepare_inputs_for_generation`` from line 667, ``_update_model_kwargs_for_generation`` from
line 1244) and ``cache_utils.py`` (``DynamicLayer.update``, lines 119-137). The model config's
``eos_token_id`` is set (every card's is), so the eos bookkeeping runs.

Before the first forward (the setup, whose small temporaries never reach the forward's peak):
for ``b > 1``, ``has_right_padding = torch.sum(...) > 0`` (utils.py:2855-2865, a 1-byte bool
alive to the end); the
attention mask ``generate`` builds from the prompt is dropped again before the loop, but the
position ids made from it (``attention_mask.long().cumsum(-1) - 1`` then ``masked_fill``,
utils.py:919-921: int64 ``[b, s]``) stay in ``generate``'s own ``model_kwargs`` to the end;
``unfinished_sequences = torch.ones(b)`` int64 (utils.py:3192). The eos and pad ids are 0-d
tensors made outside Python dispatch (``lift_fresh``): the CPU tracker does not see them.

Iteration ``i`` (``i = 0``: the prefill, ``_prefill``; ``i >= 1``: decode step ``i``):

* ``prepare_inputs_for_generation`` clones the input ids (``[b, s]``, then the last column
  ``[b, 1]``) and, for a decode step, the last position id ``[b, 1]``; the prefill's clone dies
  when ``_prefill`` returns, a decode step's when the next step's inputs replace them;
* the forward (`calc.models.hf_inference.decoder_layer` with a `_DynamicLayer`): the RoPE tables
  over the ``[b, rows]`` position ids (``[b, rows, d]``), ``DynamicLayer.update``'s ``torch.cat``
  of the cache with the new keys (a copy: at the prefill, of the keys; at a decode step the new
  cache ``[b, k, L, d]`` made while the old ``[b, k, L - 1, d]`` is alive, then the old one freed),
  keys then values; ``logits_to_keep=1``: logits ``[b, V]`` in the model dtype;
* ``_update_model_kwargs_for_generation``: ``arange(1) + position_ids[..., -1:] + 1`` then
  ``torch.cat`` to ``[b, s + i + 1]`` (the previous one dies, but not the setup's);
* ``next_token_logits = outputs.logits[:, -1].to(copy=True, dtype=float32)`` ``[b, V]`` fp32
  (the previous step's dies when rebound), ``argmax`` ``[b]`` int64 (the previous next tokens
  die), ``next_tokens * unfinished + pad * (1 - unfinished)``, ``torch.cat`` of the input ids to
  ``[b, s + i + 1]`` (the prompt stays: it is the caller's), the stopping criteria's ``[b]`` bool
  temporaries, ``unfinished & ~done`` (int64 ``[b]``), the stop check's ``max`` and ``eq``;
  ``del outputs`` frees the logits.

Decode step ``i`` attends over ``L = s + i`` cached tokens; every tensor of a decode step is
nondecreasing in ``i``, so the last step (``i = n - 1``, ``L = c - 1``) holds the decode peak.
The replay plays the prefill, the first and the last decode step (`replayed_steps`); between
them the carried state (cache, ids, positions) is re-made at the sizes it has after step
``n - 2``, dropped first so that no moment holds both. ``tests/calc/models/test_hf_generate.py``
checks that replaying every step gives the same peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from calc.config.compression import Quant
from calc.models import hf
from calc.models import reference as R
from calc.models.hf_gpt2_cache import gpt2_forward
from calc.models.hf_inference import (
    RESIDUAL,
    CacheLayer,
    Compress,
    StaticLayer,
    decoder_layer,
    no_grad_tape,
)
from calc.replay import ops
from calc.replay.kinds import StorageKind
from calc.replay.tape import Event, Size, Tape, Tensor

INT64 = 8
FP32 = 4
BOOL = 1
REPLAYED_NEW_TOKENS = 4
"""Structure of a ``generate`` replay: ``new_tokens`` above this replays as this many (the
prefill, decode step 1, and the last decode step after a jump over the steps between)."""

__all__ = ["REPLAYED_NEW_TOKENS", "replay", "replayed_new_tokens", "replayed_steps"]


def replayed_new_tokens(new_tokens: int) -> int:
    """``new_tokens`` as the compile structure sees it: at most `REPLAYED_NEW_TOKENS`."""
    return min(new_tokens, REPLAYED_NEW_TOKENS)


def replayed_steps(new_tokens: int) -> list[int]:
    """The decode steps the estimate replays: the first and the last (``1 .. new_tokens - 1``)."""
    return sorted({1, new_tokens - 1}) if new_tokens >= 2 else []


class _DynamicLayer:
    """One ``DynamicLayer`` (``keys``/``values`` grown by ``torch.cat`` at each ``update``), or
    with ``sliding`` a ``DynamicSlidingWindowLayer`` whose window the context does not reach."""

    def __init__(self, j: int, sliding: bool = False, device: str = "cpu") -> None:
        self.j = j
        self.sliding = sliding
        self.device = device
        self.window: Tensor | None = None
        self.length: Size = 0
        """Tokens the layer holds after the next update (set before each forward)."""
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def update(self, tape: Tape, sh: R.Shape, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``self.keys = torch.cat([self.keys, key_states], dim=-2)``, then the values
        (cache_utils.py:136-137): the new cache made, then the old one freed. A sliding layer
        makes both ``full_key_states`` and ``full_value_states`` before it rebinds either
        (cache_utils.py:242-247); its ``lazy_initialization`` moves the window's 0-d int64 tensor
        to the device (cache_utils.py:220: a copy on CUDA; made outside dispatch, unseen on
        the CPU)."""
        if self.sliding and self.keys is None and self.device == "cuda":
            self.window = tape.new(1, INT64, "cache.window", kind=StorageKind.KV_CACHE, tag=self.j)
        numel = sh.b * sh.k * self.length * sh.d
        keys = tape.new(numel, k.itemsize, "k_cache", kind=StorageKind.KV_CACHE, tag=self.j)
        if not self.sliding:
            tape.drop(self.keys)
        values = tape.new(numel, v.itemsize, "v_cache", kind=StorageKind.KV_CACHE, tag=self.j)
        tape.drop(self.keys if self.sliding else None, self.values)
        self.keys, self.values = keys, values
        return tape.alias(keys), tape.alias(values)

    def remake(self, tape: Tape, sh: R.Shape, length: Size, itemsize: int) -> None:
        """The layer as it is after ``length`` tokens (the jump over unreplayed steps)."""
        tape.drop(self.keys, self.values)
        numel = sh.b * sh.k * length * sh.d
        self.keys = tape.new(numel, itemsize, "k_cache", kind=StorageKind.KV_CACHE, tag=self.j)
        self.values = tape.new(numel, itemsize, "v_cache", kind=StorageKind.KV_CACHE, tag=self.j)
        self.length = length


@dataclass
class _State:
    """What ``_sample`` carries from one iteration to the next."""

    ids: Tensor | None = None
    """``input_ids`` grown by ``torch.cat`` (None: still the caller's prompt)."""
    positions: Tensor | None = None
    """``model_kwargs["position_ids"]`` grown by ``torch.cat`` (None: still the setup's)."""
    logits_f32: Tensor | None = None
    next_tokens: Tensor | None = None
    unfinished: Tensor | None = None
    inputs: list[Tensor] = field(default_factory=list)
    """The current ``model_inputs``' clones."""


def forward(
    tape: Tape, sh: R.Shape, w: R.Weights, layers: list[CacheLayer], pos: Tensor,
    mask_numel: Size | None = None,
) -> Tensor:  # fmt: skip
    """``XForCausalLM.forward(input_ids, position_ids=pos, cache, use_cache=True,
    logits_to_keep=1)`` over ``sh.s`` tokens per sequence; returns the logits ``[b, V]``.
    GPT-2: `gpt2_forward`."""
    if sh.model_type == "gpt2":
        return gpt2_forward(tape, sh, w, layers, pos, mask_numel)
    n = sh.b * sh.s
    tape.segment = "embed"
    emb = ops.embedding(tape, w.embed, n, sh.h, "embed_out")
    # no causal mask: a DynamicCache is not compileable and sdpa skips it (hf_inference)
    cos, sin = hf.rotary(tape, replace(sh, s=n), pos, emb.itemsize)  # positions [b, s]
    x = tape.alias(emb)
    for j, (lw, layer) in enumerate(zip(w.layers, layers, strict=True)):
        tape.segment = j
        x_next = decoder_layer(tape, sh, x, lw, cos, sin, layer, mask_numel)
        x_next.storage.tag = RESIDUAL
        tape.drop(x)
        x = x_next
    tape.segment = "head"
    hid = hf.rmsnorm(tape, x, w.norm, n)
    tape.drop(x, emb, cos, sin)
    last = tape.alias(hid, numel=sh.b * sh.h)  # hidden_states[:, -1:, :]
    logits = hf.linear(tape, last, w.head, None, sh.b, sh.V, "logits")
    tape.drop(last, hid)
    return logits


def _positions(tape: Tape, b: Size, length: Size, st: _State) -> None:
    """``_update_model_kwargs_for_generation``'s position ids (utils.py:1272-1280)."""
    ar = ops.plain(tape, 1, INT64, "gen.arange")  # torch.arange(num_new_tokens)
    a1 = ops.plain(tape, b, INT64, "gen.pos_add")  # + position_ids[..., -1:]
    tape.drop(ar)
    a2 = ops.plain(tape, b, INT64, "gen.pos_next")  # + 1
    tape.drop(a1)
    pos = ops.plain(tape, b * length, INT64, "gen.position_ids")  # torch.cat
    tape.drop(a2, st.positions)
    st.positions = pos


def _select(tape: Tape, b: Size, V: Size, st: _State) -> None:
    """``next_token_logits`` (utils.py:3248), ``argmax`` (3279) and the eos masking (3283)."""
    lf = ops.plain(tape, b * V, FP32, "gen.next_token_logits")  # .to(copy=True, dtype=float32)
    tape.drop(st.logits_f32)
    am = ops.plain(tape, b, INT64, "gen.argmax")
    tape.drop(st.next_tokens)
    m1 = ops.plain(tape, b, INT64, "gen.eos_mul")  # next_tokens * unfinished_sequences
    r = ops.plain(tape, b, INT64, "gen.eos_rsub")  # 1 - unfinished_sequences
    m2 = ops.plain(tape, b, INT64, "gen.eos_pad")  # pad_token_id * (...)
    tape.drop(r)
    nt = ops.plain(tape, b, INT64, "gen.next_tokens")
    tape.drop(m1, m2, am)
    st.logits_f32, st.next_tokens = lf, nt


def _stop(tape: Tape, b: Size, length: Size, st: _State) -> None:
    """``input_ids = torch.cat(...)`` (utils.py:3286), the stopping criteria and
    ``unfinished_sequences & ~done`` (3288), the stop check (3289)."""
    ids = ops.plain(tape, b * length, INT64, "gen.input_ids")
    tape.drop(st.ids)
    st.ids = ids
    f1 = ops.plain(tape, b, BOOL, "stop.full")  # MaxLengthCriteria, EosTokenCriteria
    f2 = ops.plain(tape, b, BOOL, "stop.full")
    o1 = ops.plain(tape, b, BOOL, "stop.or")
    tape.drop(f1, f2)
    isin = ops.plain(tape, b, BOOL, "stop.isin")
    anyb = ops.plain(tape, b, BOOL, "stop.any")
    tape.drop(isin)
    o2 = ops.plain(tape, b, BOOL, "stop.or")
    tape.drop(anyb, o1)
    nd = ops.plain(tape, b, BOOL, "stop.not")
    tape.drop(o2)
    un = ops.plain(tape, b, INT64, "gen.unfinished")
    tape.drop(nd, st.unfinished)
    st.unfinished = un
    mx = ops.plain(tape, 1, INT64, "stop.max")
    eq = ops.plain(tape, 1, BOOL, "stop.eq")
    tape.drop(mx, eq)


def _bookkeeping(tape: Tape, sh: R.Shape, length: Size, logits: Tensor, st: _State) -> None:
    """What ``_sample`` does after a forward whose sequences now hold ``length`` tokens."""
    _positions(tape, sh.b, length, st)
    _select(tape, sh.b, sh.V, st)
    _stop(tape, sh.b, length, st)
    tape.drop(logits)  # del outputs


def _static_mask(tape: Tape, b: Size, context: Size, batch_over_one: bool) -> Tensor:
    """``create_masks_for_generate`` for a one-token step over a static cache of ``context``
    (utils.py:748-760, ``masking_utils.sdpa_mask``): the int64 index ranges, the ``le``
    comparison ``[1, 1, 1, c]`` bool, expanded to ``[b, 1, 1, c]`` and made contiguous by
    ``prepare_inputs_for_generation`` (a copy for ``b > 1``)."""
    ab = ops.plain(tape, b, INT64, "mask.batch_arange")
    a1 = ops.plain(tape, 1, INT64, "mask.head_arange")
    a2 = ops.plain(tape, 1, INT64, "mask.q_arange")
    aq = ops.plain(tape, 1, INT64, "mask.q_index")
    tape.drop(a2)
    ak = ops.plain(tape, context, INT64, "mask.kv_arange")
    akv = ops.plain(tape, context, INT64, "mask.kv_index")
    tape.drop(ak)
    le = ops.plain(tape, context, BOOL, "mask.causal")
    tape.drop(ab, a1, aq, akv)
    if not batch_over_one:
        return le
    mask = ops.plain(tape, b * context, BOOL, "mask.contiguous")
    tape.drop(le)
    return mask


def _decode_step(
    tape: Tape, sh: R.Shape, w: R.Weights, layers: list, length: Size, st: _State,
    static: tuple[Size, bool] | None = None,
) -> None:  # fmt: skip
    """One decode step: the cache holds ``length`` tokens after it. ``static``: (the static
    cache's length, ``b > 1``), the step then builds and passes a boolean mask."""
    b = sh.b
    ids = ops.plain(tape, b, INT64, "gen.input_clone")  # input_ids[:, -1:].clone()
    pos = ops.plain(tape, b, INT64, "gen.position_clone")  # position_ids[..., -1:].clone()
    made = [ids, pos]
    if static is not None:
        made.append(_static_mask(tape, b, static[0], static[1]))
    tape.drop(*st.inputs)
    st.inputs = made
    _grow(layers, length)
    mask_numel = None if static is None else b * static[0]
    logits = forward(tape, replace(sh, s=1), w, layers, pos, mask_numel)
    _bookkeeping(tape, sh, length + 1, logits, st)


def replay(
    sh: R.Shape,
    context: Size,
    new_tokens: int,
    steps: list[int] | None = None,
    compress: Compress | None = None,
    quant: Quant | None = None,
    compute: str = "bf16",
    batch_over_one: bool = True,
    sliding: bool = False,
    static: bool = False,
) -> list[Event]:
    """The replay of ``generate`` for symbolic or int sizes: ``sh.s`` prompt tokens,
    ``new_tokens`` generated, ``context = s + new_tokens``. ``steps``: the decode steps to play
    (default `replayed_steps`; ``range(1, new_tokens)`` plays every one). A step ``i`` after a
    skipped one is sized from ``context`` (``L = context - (new_tokens - i)``), a step after the
    prefill or a played step from the prompt (``L = s + i``). ``batch_over_one``: ``b > 1``
    (only then does ``generate`` test the prompts for right padding); ``sliding``: every layer
    a ``DynamicSlidingWindowLayer`` (mistral), its window longer than the context; ``static``:
    ``cache_implementation="static"``, a `calc.models.hf_inference.StaticLayer` of ``context -
    1`` tokens per layer (allocated at its first update)."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens} must be >= 1 for generate")
    tape, w = no_grad_tape(sh, quant, compute, compress)
    b, s = sh.b, sh.s
    tape.existing(b * s, INT64, "input_ids", StorageKind.INPUT)
    if sh.model_type != "gpt2":  # the rotary embedding's buffers
        half = sh.d // 2 if isinstance(sh.d, int) else sh.d / 2
        tape.existing(half, sh.weight_itemsize, "rotary.inv_freq", StorageKind.BUFFER)
        tape.existing(half, sh.weight_itemsize, "rotary.original_inv_freq", StorageKind.BUFFER)
    tape.phase = "prefill"
    tape.segment = "embed"
    if batch_over_one:  # utils.py:2855-2865 (batch_size > 1), alive to the end
        ops.plain(tape, 1, BOOL, "gen.has_right_padding")
    pos0 = ops.plain(tape, b * s, INT64, "gen.position_ids0")  # utils.py:919-921, to the end
    st = _State(unfinished=ops.plain(tape, b, INT64, "gen.unfinished"))
    clone = ops.plain(tape, b * s, INT64, "gen.input_clone")  # input_ids.clone()
    # a static cache of max_length - 1 = context - 1 tokens (utils.py:2963): the last new token
    # is never fed to the model
    static_len = context - 1
    layers: list = (
        [StaticLayer(tape, j, static_len, sh.device) for j in range(sh.n_layers)]
        if static
        else [_DynamicLayer(j, sliding, sh.device) for j in range(sh.n_layers)]
    )
    _grow(layers, s)
    logits = forward(tape, sh, w, layers, pos0)
    tape.segment = "head"
    tape.drop(clone)  # _prefill returns
    _bookkeeping(tape, sh, s + 1, logits, st)
    played = 0
    for i in replayed_steps(new_tokens) if steps is None else steps:
        tape.phase = "decode"
        length = s + i if i == played + 1 else context - (new_tokens - i)
        if i != played + 1:  # the jump: the state after step i - 1
            _jump(tape, sh, layers, context - (new_tokens - i) - 1, st)
        _decode_step(
            tape, sh, w, layers, length, st, (static_len, batch_over_one) if static else None
        )
        played = i
    return tape.events


def _grow(layers: list, length: Size) -> None:
    """A dynamic cache holds ``length`` tokens after the next forward (a static one its size)."""
    for layer in layers:
        if isinstance(layer, _DynamicLayer):
            layer.length = length


def _jump(tape: Tape, sh: R.Shape, layers: list, length: Size, st: _State) -> None:
    """Re-make the carried state at ``length`` cached tokens (``length + 1`` ids); a static
    cache keeps its size."""
    for layer in layers:
        if not isinstance(layer, _DynamicLayer):
            continue
        tape.segment = layer.j
        assert layer.keys is not None
        layer.remake(tape, sh, length, layer.keys.itemsize)
    tape.segment = "head"
    tape.drop(st.ids, st.positions)
    st.positions = ops.plain(tape, sh.b * (length + 1), INT64, "gen.position_ids")
    st.ids = ops.plain(tape, sh.b * (length + 1), INT64, "gen.input_ids")
