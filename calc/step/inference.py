"""The inference pass the cost model replays: a prefill into a static KV cache, event by event.

It follows `verify.models.reference_inference` (plain PyTorch over `verify.models.reference.ReferenceLM`,
under ``torch.no_grad()``) line by line:

* the cache: per layer a K and a V ``zeros(b, k, c, d)`` in the model dtype, allocated before the
  forward (layer 0 K, layer 0 V, layer 1 K, ...), ``kind="kv_cache"``, tagged with its layer;
* the prefill (phase ``prefill``): the model's forward over the ``s`` prompt tokens with grad mode
  off. Each layer runs exactly the ops of training's forward (`calc.models.reference.block`): the
  cache writes (``cache[:, :, :s] = k``, ``copy_``) and the reads (``cache[:, :, :s]``, a view
  the CPU flash kernel takes without a copy, measured) allocate nothing, and with no autograd
  nodes nothing is saved, so every tensor dies when its Python reference does. The final norm
  runs over all ``b*s`` rows, the head over the last position only (``hidden[:, -1:]``, viewed
  as ``[b, h]`` without a copy): logits ``[b, V]``, as generation with ``logits_to_keep=1``;
* optionally one decode step (phase ``decode``): the same forward for one token (``s = 1``)
  attending over the cache, at position ``s`` (the prompt's length).

Weights, the RoPE tables ``[c, d]`` (``set_rope(context)``) and the prompt ids exist before the
replay starts. Sizes are symbols: ``b`` batch, ``s`` prompt, ``c`` context and the model's
``h, a, k, d, f, V, P``.
"""

from __future__ import annotations

from dataclasses import replace

from calc import symbols as S
from calc.compress import kv_quant as kvq
from calc.compress.lora import compress_weights
from calc.config.compression import Quant
from calc.config.jobs import Inference
from calc.config.model_spec import ModelSpec
from calc.models import hf_generate, hf_gpt2_cache, reference, shape
from calc.models.hf_inference import check as check_hf
from calc.models.hf_inference import replay_hf_prefill
from calc.models.shape import shape_for_inference
from calc.replay import ops
from calc.replay.tape import Event, Size, Tape, Tensor

INDEX_ITEMSIZE = 8  # int64 token ids and positions
RESIDUAL = "residual"
"""Tag of the residual stream between layers (a block's output): at most one is live."""


def kv_cache(tape: Tape, sh: reference.Shape, context: Size) -> list[tuple[Tensor, Tensor]]:
    """``new_cache``: K then V ``zeros(b, k, c, d)`` per layer, each tagged with its layer."""
    numel = sh.b * sh.k * context * sh.d
    cache = []
    for j in range(sh.n_layers):
        tape.segment = j
        kc = tape.new(numel, sh.weight_itemsize, "k_cache", kind="kv_cache", tag=j)
        vc = tape.new(numel, sh.weight_itemsize, "v_cache", kind="kv_cache", tag=j)
        cache.append((kc, vc))
    return cache


def forward(
    tape: Tape, sh: reference.Shape, w: reference.Weights, cos: Tensor | None,
    sin: Tensor | None,
) -> Tensor:  # fmt: skip
    """``reference_inference._forward`` for ``sh.s`` tokens: logits ``[b, V]`` of the last one.

    The cache is written and read through views (no events), so a layer is training's forward
    block (`reference.block`) with grad mode off."""
    n = sh.b * sh.s
    tape.segment = "embed"
    x, pos = reference.embed_no_grad(tape, sh, w)  # GPT-2's positions: a local until the end
    for j, lw in enumerate(w.layers):
        tape.segment = j
        x_next = reference.block(tape, sh, x, lw, cos, sin)
        # The block's output outlives its layer (it is the next block's input) but nothing
        # else of the layer does: tagged as a layer tensor it would make `calc.replay.timeline` count
        # it once per middle layer at events of the next layer. No layer owns it.
        x_next.storage.tag = RESIDUAL
        tape.drop(x)
        x = x_next
    tape.segment = "head"
    hid = reference.norm(tape, sh, x, w.norm, w.norm_b, n)
    tape.drop(x)
    last = tape.alias(hid, numel=sh.b * sh.h)  # hidden[:, -1:]
    logits = ops.linear(tape, last, w.head, None, sh.b, sh.V, "logits")
    tape.drop(last, hid, pos)
    return logits


def _check(model: ModelSpec, job: Inference, sh: reference.Shape) -> None:
    if job.implementation != "reference":
        raise NotImplementedError(f"implementation={job.implementation!r} is not modelled yet")
    if sh.attention not in ("flash", "efficient"):
        raise NotImplementedError(
            f"inference with attention kernel {sh.attention!r} is not modelled yet; "
            "attention='sdpa' (flash or efficient) is"
        )


def replay_inference(
    model: ModelSpec, job: Inference, device: str, n_layers: int, decode: bool = False
) -> list[Event]:
    """Replay the prefill of ``job`` (and with ``decode=True`` one decode step after it) with
    ``n_layers`` concrete layers; sizes in the symbols ``b, s, c`` and the model's."""
    if job.padding != "none":  # calc.estimate.api falls back to the derived replay
        raise NotImplementedError(
            f"padding={job.padding!r} (the prompts' attention mask) is recorded from "
            "transformers' code (the derived replay), not written by hand"
        )
    if job.new_tokens > 0:  # HF generate: `calc.models.hf_generate`
        return replay_generate(model, job, device, n_layers)
    if job.implementation == "hf" and model.model_type == "gpt2":  # `calc.models.hf_gpt2_cache`
        return hf_gpt2_cache.replay_prefill(model, job, device, n_layers, compress_weights)
    if job.implementation == "hf":  # HF StaticCache prefill: `calc.models.hf_inference`
        if decode:
            raise NotImplementedError("implementation='hf' decode is not modelled yet")
        return replay_hf_prefill(model, job, device, n_layers, compress_weights)
    sh = shape_for_inference(model, job, device, n_layers)
    _check(model, job, sh)
    return replay(
        sh, S.c, decode=decode, quant=job.quant, compute=job.precision, kv_quant=job.kv_quant
    )


def replayed_new_tokens(job: Inference) -> int:
    """``job.new_tokens`` as the compile structure sees it (`calc.models.hf_generate`)."""
    return hf_generate.replayed_new_tokens(job.new_tokens)


def replay_generate(model: ModelSpec, job: Inference, device: str, n_layers: int) -> list[Event]:
    """Replay HF ``generate`` of ``job`` (`calc.models.hf_generate`): the prefill and the decode
    steps `calc.models.hf_generate.replayed_steps` picks, sizes in ``b, s, c``."""
    if job.implementation != "hf":
        raise NotImplementedError(
            "generate (new_tokens > 0) is modelled for implementation='hf' only"
        )
    if job.kv_quant is not None:
        raise NotImplementedError("generate with a quantized KV cache is not modelled")
    if job.sampling is not None:  # calc.estimate.api falls back to the derived replay
        raise NotImplementedError(
            "generate with sampling is recorded from transformers' code (the derived replay), "
            "not written by hand"
        )
    if job.num_beams > 1 or job.output_scores or job.output_logits:  # the same fallback
        raise NotImplementedError(
            "generate with beam search or kept scores/logits is recorded from transformers' "
            "code (the derived replay), not written by hand"
        )
    if model.sliding_window is not None and model.model_type != "mistral":
        raise NotImplementedError(
            f"generate for {model.model_type} with a sliding window is not modelled yet"
        )
    sh = shape_for_inference(model, job, device, n_layers)
    # a one-token prompt into a dynamic cache takes the decode steps' path (no mask): only the
    # static cache's one-token prefill is refused by the prefill's check
    check_hf(model, replace(job, prompt=2, context=0) if job.cache_impl == "dynamic" else job, sh)
    return hf_generate.replay(
        sh,
        S.c,
        hf_generate.replayed_new_tokens(job.new_tokens),
        compress=compress_weights,
        quant=job.quant,
        compute=job.precision,
        batch_over_one=job.batch > 1,
        sliding=model.sliding_window is not None,
        static=job.cache_impl == "static",
    )


def numeric_shape(model: ModelSpec, job: Inference, device: str) -> tuple[reference.Shape, int]:
    """`calc.models.shape.numeric_shape` with this implementation's refusals."""
    return shape.numeric_shape(model, job, device, _check)


def replay(
    sh: reference.Shape, context: Size, decode: bool = False, quant: Quant | None = None,
    compute: str = "bf16", kv_quant: str | None = None,
) -> list[Event]:  # fmt: skip
    """The replay itself, for symbolic or int sizes (``sh.s`` prompt, ``context`` cache);
    ``quant``: the decoder linears stored quantized (`calc.compress.quant`), computing in ``compute``;
    ``kv_quant``: the KV cache stored in int8/fp8 (`calc.compress.kv_quant`)."""
    tape = Tape(inplace_accumulate=sh.device == "cuda")
    tape.grad_enabled = False
    w = reference.Weights(tape, sh)
    if quant is not None:
        compress_weights(tape, w, sh, None, quant, compute)
    tape.existing(sh.b * sh.s, INDEX_ITEMSIZE, "input_ids", "input")
    rope = sh.model_type != "gpt2"
    cos = tape.existing(context * sh.d, sh.weight_itemsize, "rope_cos", "buffer") if rope else None
    sin = tape.existing(context * sh.d, sh.weight_itemsize, "rope_sin", "buffer") if rope else None
    tape.phase = "prefill"
    if kv_quant is not None and sh.model_type == "gpt2":
        raise NotImplementedError("a quantized KV cache for GPT-2 is not modelled")
    if kv_quant is None:
        kv_cache(tape, sh, context)
    else:
        kvq.cache(tape, kv_quant, sh.b, sh.k, sh.d, context, sh.weight_itemsize, sh.n_layers)
        tape.kv_hook = kvq.attend_hook(kv_quant, sh.s, sh.b * sh.k * sh.d, sh.d)
    logits = forward(tape, sh, w, cos, sin)
    tape.drop(logits)
    if decode:
        tape.phase = "decode"
        tape.existing(sh.b, INDEX_ITEMSIZE, "next_id", "input")
        if kv_quant is not None:
            tape.kv_hook = kvq.attend_hook(kv_quant, sh.s + 1, sh.b * sh.k * sh.d, sh.d)
        logits = forward(tape, replace(sh, s=1), w, cos, sin)
        tape.drop(logits)
    return tape.events
