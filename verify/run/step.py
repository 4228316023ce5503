"""The training-step protocol every case runs, and the pins that decide its memory.

``calc.step.training.replay_training`` models exactly this loop::

    for step in (1, 2):                 # step 1 creates optimizer states lazily; step 2 is steady
        for each micro-batch:
            mark("step{n}/forward");  loss = model(ids, targets)   (under autocast for amp-*)
            amp-fp16: loss = scaler.scale(loss)
            zero_grad == "before_backward" and first micro-batch: zero_grad(set_to_none=True)
            mark("step{n}/backward"); loss.backward(); del loss
        mark("step{n}/optimizer"); optimizer step; zero_grad == "after_step": zero_grad(...)

``model(ids, targets)`` is the model's own loss, or, for another ``loop``/``loss``,
`verify.models.loops.Loop` (which may hold the output until the next forward returns); with
``optimizer=None`` the step does nothing and ``zero_grad`` is ``model.zero_grad``.

Inputs are built before measuring starts; model and optimizer are built inside the meter (the
caller's job, see `verify.run.runner`). A meter is anything with ``mark(phase)``: the CPU
`verify.measure.tracker.StorageTracker` or the CUDA meter of `verify.run.runner`.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from calc.config.hf_config import hf_config_dict
from calc.derive.replay import head_dims_differ
from calc.models.attention import attention_kernel
from verify.models import reference_inference

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from calc.config.jobs import Inference, Training
    from calc.config.model_spec import ModelSpec
    from verify.models.build import OptBundle

AUTOCAST_DTYPE: dict[str, torch.dtype] = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}
"""Autocast dtype of each ``amp-*`` precision."""
INFERENCE_DTYPE: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


class Meter(Protocol):
    """What the protocol needs from a measuring backend."""

    def mark(self, phase: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Pins:
    """Everything that decides a case's memory besides the model's sizes, as recorded."""

    kernel: str
    """Attention kernel calc says CUDA runs (``flash``/``efficient``/``cudnn``/``math``/``eager``)."""
    sdpa_backend: str
    """Backend forced with ``torch.nn.attention.sdpa_kernel`` on this device: ``flash``,
    ``efficient``, ``cudnn``, ``math``, or ``none`` (eager attention: no SDPA call)."""
    optimizer: str
    optimizer_impl: str
    """``foreach``/``fused``/``for-loop``, passed explicitly to ``torch.optim``."""
    autocast_dtype: str | None
    grad_scaler: bool
    zero_grad: str
    tied_embeddings: bool
    dropout: tuple[float, float, float]
    """(attention, hidden, embedding) dropout probabilities of the model that ran."""
    seed: int
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def calc_kernel(spec: ModelSpec, job: Training | Inference, compute_16bit: bool = False) -> str:
    """The attention kernel calc says CUDA runs (`calc.models.attention.attention_kernel`;
    ``compute_16bit``: an fp32 model whose FSDP mixed-precision policy computes in bf16)."""
    return attention_kernel(spec, job, compute_16bit)


def sdpa_backend_for(kernel: str, device: str, dropout: float) -> tuple[str, str]:
    """(backend to force, note). On CPU flash/efficient/cudnn run as the CPU flash kernel and
    math as math. CPU flash has no dropout, so with attention dropout it falls back to math."""
    if kernel == "eager":
        return "none", ""
    if device == "cuda":
        return kernel, ""
    if kernel == "math":
        return "math", ""
    if dropout > 0:
        return "math", f"CPU flash SDPA has no dropout: {kernel} runs as math on CPU"
    return "flash", ""


def pins_for(
    spec: ModelSpec,
    job: Training | Inference,
    *,
    seed: int,
    device: str,
    compute_16bit: bool = False,
) -> Pins:
    """The pins of ``job`` on ``spec`` (the model as run, dropout applied; ``compute_16bit``:
    see `calc_kernel`)."""
    kernel = calc_kernel(spec, job, compute_16bit)
    training = hasattr(job, "optimizer")
    p_attn = spec.attention_dropout if training else 0.0  # inference runs in eval mode
    backend, note = sdpa_backend_for(kernel, device, p_attn)
    if backend == "flash" and head_dims_differ(hf_config_dict(spec)):
        if device == "cpu":
            backend, note = "math", "CPU flash SDPA needs equal q/k and v head dims: math"
        else:  # sdp_utils.cpp: check_head_dim_size_flash wants one last dim for q, k and v
            backend, note = "efficient", "CUDA flash SDPA needs equal q/k and v head dims"
    amp = AUTOCAST_DTYPE.get(job.precision)
    return Pins(
        kernel=kernel,
        sdpa_backend=backend,
        optimizer=job.optimizer if training else "",
        optimizer_impl=job.optimizer_impl if training else "",
        autocast_dtype=str(amp).removeprefix("torch.") if amp is not None else None,
        grad_scaler=job.precision == "amp-fp16",
        zero_grad=job.zero_grad if training else "",
        tied_embeddings=spec.tied_embeddings,
        dropout=(spec.attention_dropout, spec.hidden_dropout, spec.embedding_dropout),
        seed=seed,
        note=note,
    )


_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


@contextlib.contextmanager
def forced_sdpa(backend: str) -> Iterator[None]:
    """``sdpa_kernel`` restricted to ``backend`` (no-op for ``none``)."""
    if backend == "none":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, _BACKENDS[backend])):
        yield


def make_batch(
    spec: ModelSpec, batch: int, seq: int, *, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, int64 ``[batch, seq]``, from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab, (batch, seq), generator=gen)
    targets = torch.randint(0, spec.vocab, (batch, seq), generator=gen)
    return ids.to(device), targets.to(device)


def make_prompts(
    spec: ModelSpec, job: Inference, *, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prompt ids ``[batch, prompt]`` (`make_batch`'s) and, for ``job.padding == "left"``,
    their attention mask as a tokenizer returns it for prompts of different lengths padded on
    the left: int64 ones, the first row's first quarter of the prompt (at least one token) 0
    and its ids token 0 (a stand-in pad token: with the mask passed, no value is read).
    ``None`` for unpadded prompts."""
    ids, _ = make_batch(spec, job.batch, job.prompt_len, seed=seed, device=device)
    if job.padding == "none":
        return ids, None
    pad = max(job.prompt_len // 4, 1)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    ids[0, :pad] = 0
    return ids, mask


def micro_batches(
    step: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ids: torch.Tensor,
    targets: torch.Tensor,
    job: Training,
    meter: Meter,
    *,
    scale: Callable[[torch.Tensor], torch.Tensor],
    zero_grad: Callable[[], None],
    backward: Callable[[torch.Tensor], None] | None = None,
    device_type: str = "cpu",
) -> None:
    """The ``job.grad_accum`` micro-batches of optimizer step ``step`` (the inner loop of the
    protocol above): forward under autocast for ``amp-*``, ``scale`` (the GradScaler's), the
    ``before_backward`` zero_grad at the first one, then ``backward`` (``loss.backward()``
    unless given) and the loss dropped."""
    amp = AUTOCAST_DTYPE.get(job.precision)
    for mb in range(job.grad_accum):
        meter.mark(f"step{step}/forward")
        ctx = (
            torch.autocast(device_type, dtype=amp) if amp is not None else contextlib.nullcontext()
        )
        with ctx:
            loss = loss_fn(ids, targets)
        loss = scale(loss)
        if job.zero_grad == "before_backward" and mb == 0:
            zero_grad()
        meter.mark(f"step{step}/backward")
        if backward is not None:
            backward(loss)
        else:
            loss.backward()
        del loss


def train_two_steps(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    bundle: OptBundle,
    ids: torch.Tensor,
    targets: torch.Tensor,
    job: Training,
    pins: Pins,
    meter: Meter,
    *,
    device_type: str = "cpu",
) -> None:
    """Run the protocol above: two optimizer steps of ``job.grad_accum`` micro-batches each."""
    with forced_sdpa(pins.sdpa_backend):
        for step in (1, 2):
            micro_batches(step, loss_fn, ids, targets, job, meter, scale=bundle.scale,
                          zero_grad=bundle.zero_grad, device_type=device_type)  # fmt: skip
            meter.mark(f"step{step}/optimizer")
            bundle.step()
            if job.zero_grad == "after_step":
                bundle.zero_grad()


def prefill(
    model: torch.nn.Module, ids: torch.Tensor, job: Inference, pins: Pins, meter: Meter,
    mask: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """One prefill of ``ids`` into a KV cache of ``job.context`` tokens under ``no_grad``.

    hf: a ``StaticCache`` of ``context`` tokens and ``logits_to_keep=1``, the prompts'
    attention ``mask`` passed when given (`make_prompts`). reference: the KV-cache helper of
    `verify.models.reference_inference` (``prefill(model, ids, context)``).
    """
    model.eval()
    meter.mark("prefill")
    with torch.no_grad(), forced_sdpa(pins.sdpa_backend):
        if job.new_tokens > 0:
            generate(model, ids, job, mask)
        elif job.implementation in ("hf", "derived"):
            import transformers

            cache = transformers.StaticCache(config=model.config, max_cache_len=job.context)
            # transformers 5.x: ``cache=`` (``past_key_values=`` is deprecated)
            kw: dict[str, Any] = (
                {"cache": cache} if _takes_cache(model) else {"past_key_values": cache}
            )
            if mask is not None:
                kw["attention_mask"] = mask
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw)
            del out, cache
        else:
            logits = reference_inference.prefill(
                model, ids, job.context, getattr(job, "kv_quant", None)
            )
            del logits


def generate(
    model: torch.nn.Module, ids: torch.Tensor, job: Inference, mask: torch.Tensor | None = None
) -> None:
    """``model.generate(ids, max_new_tokens=job.new_tokens)``, greedy (or ``job.sampling``'s
    ``do_sample=True`` and processors; ``job.num_beams`` beams when more than 1:
    `calc.Inference.decoding_kwargs`), the prompts' attention ``mask`` passed when given
    (left padding, `make_prompts`; none: one unpadded prompt per row), the cache ``job.cache_impl`` (``static``:
    ``cache_implementation="static"``), an eos token set (token 0 where the config has none);
    the output ids are dropped at once. Eager: ``disable_compile=True``, since on CUDA a static
    cache makes transformers compile the decode step (``_valid_auto_compile_criteria`` in
    ``generation/utils.py``: a compileable cache on a CUDA device), which calc does not model."""
    kw: dict[str, Any] = {"cache_implementation": "static"} if job.cache_impl == "static" else {}
    kw["disable_compile"] = True
    # a cache, as generation_config.json gives every published checkpoint (GenerationConfig's
    # default); a model built from a config.json with "use_cache": false (OLMo-2-Instruct's,
    # many fine-tunes') would otherwise generate without one, re-reading the whole sequence
    kw["use_cache"] = True
    if model.generation_config.eos_token_id is None:
        # every published card sets an eos token (and generate's eos bookkeeping runs); the
        # scaled configs of some families (qwen2) leave it unset: token 0 stands in
        kw["eos_token_id"] = 0
    kw.update(job.decoding_kwargs())  # greedy, sampling's processors, beams
    if mask is not None:
        kw["attention_mask"] = mask
    out = model.generate(ids, max_new_tokens=job.new_tokens, **kw)
    del out


def _takes_cache(model: torch.nn.Module) -> bool:
    import inspect

    return "cache" in inspect.signature(model.forward).parameters
