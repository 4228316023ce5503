"""Recording what the real modeling code allocates and frees, on fake tensors.

The model ``transformers`` builds from the config (``AutoModelForCausalLM.from_config``) runs
the protocol of verify's hf cases (``verify/run/step.py``: two optimizer steps of
``grad_accum`` micro-batches; or one prefill into a ``StaticCache``) under
``torch._subclasses.fake_tensor.FakeTensorMode``: every tensor has its shape, dtype and storage
size, and no memory. `calc.derive.book` keeps the storages with the CPU tracker's rules; here
forward hooks on the decoder layers say which layer runs, and parameters, gradients and
optimizer states are filed under their parameter's layer and name.

torch and transformers are imported only inside these functions: ``calc`` imports without them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from calc.config.jobs import Inference, Training
from calc.derive import bnb, inductor, lion, loops, lora, offload, quantized, sac, sharding
from calc.derive.book import (
    Book,
    DeriveError,
    Trace,
    eager_paths,
    quiet,
    recorder,
    storage_of,
    tensors_in,
)
from calc.derive.generate import cut, stop_after
from calc.derive.native import LocalOptimizer, Native, Rank, distribute, native_world
from calc.replay.kinds import StorageKind

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

_WEIGHT_DTYPE = {
    "fp32": "float32",
    "amp-bf16": "float32",
    "amp-fp16": "float32",
    "bf16": "bfloat16",
    "bf16-master": "bfloat16",
    "fp16": "float16",
}
"""The weights' dtype of each precision (``verify/models/build.py``, ``WEIGHT_DTYPE``)."""
_AUTOCAST = {"amp-bf16": "bfloat16", "amp-fp16": "float16"}
RECORDING = threading.RLock()
"""Held by a recording `session` and by every build of transformers' model: one at a time in a
process. Both set state that is not the thread's own (the global RNG's seed, the eager-path and
warning patches of `calc.derive.book`, Dynamo's caches), so a recording in another thread (the
web app's prefetch thread, a second user's session) ran under the first one's: four concurrent
recordings of a tiny Mixtral, two refused ("the ops it runs change with the sizes"). Reading a
config takes it too: transformers' lazy module, imported by two threads at once, lacked
``AutoConfig`` in one of them."""
F = TypeVar("F", bound=Callable[..., Any])


def _one_at_a_time(fn: F) -> F:
    """``fn`` run holding `RECORDING`."""

    @functools.wraps(fn)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with RECORDING:
            return fn(*args, **kwargs)

    return locked  # type: ignore[return-value]


def _layer_list(model: Any, n_layers: int) -> tuple[str, Any]:
    """(qualified name, ModuleList) of the decoder layers: the ``ModuleList`` of ``n_layers``
    modules (``model.layers`` in most ``*ForCausalLM``, ``transformer.h`` in GPT-2)."""
    import torch

    found = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n_layers
    ]
    if not found:
        raise DeriveError(f"no ModuleList of {n_layers} decoder layers found in the model")
    return min(found, key=lambda item: item[0].count("."))


def _param_tags(model: Any, prefix: str) -> dict[str, tuple[object, str]]:
    """Parameter/buffer name -> (layer tag, name with the layer index written ``*``)."""
    emb = model.get_input_embeddings()
    out_emb = model.get_output_embeddings()
    special = {id(p): "embed" for p in emb.parameters()}
    if out_emb is not None:
        for p in out_emb.parameters():
            special.setdefault(id(p), "head")
    tags: dict[str, tuple[object, str]] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    for name, p in named:
        tag: object = special.get(id(p), "base")
        short = name
        if name.startswith(prefix + "."):
            index, _, rest = name[len(prefix) + 1 :].partition(".")
            if index.isdigit():
                tag, short = int(index), f"{prefix}.*.{rest}"
        tags.setdefault(name, (tag, short))
    return tags


def _vocab(config: dict[str, Any]) -> int:
    return int(config["vocab_size"])


def first_sentence(text: str, limit: int = 240) -> str:
    """The first line of an error, up to its first sentence and ``limit`` characters (some
    list every model type transformers knows)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    head = line.split(". ")[0]
    return head if len(head) <= limit else head[: limit - 3] + "..."


CHECKPOINT_DTYPE_KEYS = ("torch_dtype", "dtype")
"""Config keys naming the checkpoint's dtype. ``from_config`` builds the model in that dtype
(transformers 5.24), so a real config (``"torch_dtype": "bfloat16"``) would give bf16 weights
whatever the job's precision: they are left out, and the job's precision alone sets the dtype
(`_built`)."""


def _config_fields(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(model type, the other keys) of ``config``, deep-copied: transformers' config classes
    complete nested dicts in place (``rope_scaling``), and the caller's dict is a cache key.
    The checkpoint's dtype is left out (`CHECKPOINT_DTYPE_KEYS`)."""
    fields = copy.deepcopy(dict(config))
    for key in CHECKPOINT_DTYPE_KEYS:
        fields.pop(key, None)
    return str(fields.pop("model_type")), fields


@_one_at_a_time
def _build(config: dict[str, Any], attention: str) -> Any:
    """``AutoModelForCausalLM.from_config`` of ``config``; any failure is a `DeriveError` naming
    the model type and what transformers said."""
    import torch
    import transformers

    model_type, fields = _config_fields(config)
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **fields)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attention)
    except Exception as exc:  # transformers raises many kinds; one message for the user
        raise DeriveError(
            f"transformers {transformers.__version__} cannot build model_type={model_type!r} "
            f"as AutoModelForCausalLM: {type(exc).__name__}: {first_sentence(str(exc))}"
        ) from exc


@_one_at_a_time
def sdpa_supported(config: dict[str, Any]) -> bool:
    """Whether transformers builds the model ``config`` describes with SDPA attention (its
    ``*ForCausalLM`` class's ``_supports_sdpa``; Gemma-2's is False, for its soft-capping). A
    model without it is built with eager attention when none is asked for
    (``modeling_utils.py``, ``_check_and_adjust_attn_implementation``)."""
    import transformers

    model_type, fields = _config_fields(config)
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **fields)
        return class_supports_sdpa(cfg)
    except Exception:  # the build says what is wrong, once (`_build`)
        return True


@_one_at_a_time
def class_supports_sdpa(cfg: Any) -> bool:
    """The ``_supports_sdpa`` flag of the ``*ForCausalLM`` class of transformers' config object
    ``cfg`` (``KeyError`` for a type with no such class)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return bool(getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)], "_supports_sdpa", True))


@_one_at_a_time
def layer_types(config: dict[str, Any]) -> list[str]:
    """The per-layer kinds transformers' config object holds (``layer_types``: what the config
    class builds when the config.json has none, e.g. Gemma-2's alternating sliding and full
    attention), or ``[]`` when it has none."""
    import transformers

    model_type, fields = _config_fields(config)
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # one message, as for the build
        raise DeriveError(
            f"transformers {transformers.__version__} cannot read a config of "
            f"model_type={model_type!r}: {type(exc).__name__}: {first_sentence(str(exc))}"
        ) from exc
    types = getattr(cfg, "layer_types", None)
    return [str(t) for t in types] if isinstance(types, list | tuple) else []


_INDEX_WORDS = ("idx", "index", "layer_id")
"""Attribute names that hold a layer's position, not its kind (left out of its signature)."""


@_one_at_a_time
def layer_signatures(config: dict[str, Any]) -> list[tuple]:
    """One hashable per decoder layer of the model ``config`` describes (built on the ``meta``
    device), equal for two layers exactly when they are built alike: the config's per-layer
    kind (``layer_types``), and for every submodule its name, class and plain attributes (an
    attention's ``sliding_window``, ``is_sliding``; its position ``layer_idx`` left out), and
    every parameter's and buffer's name, shape and dtype (`calc.derive.period`)."""
    import torch

    with torch.device("meta"):
        model = _build(config, "eager")
    _, layers = _layer_list(model, _layers_of(model))
    types = getattr(model.config, "layer_types", None)
    out = []
    for i, layer in enumerate(layers):
        parts: list[object] = [str(types[i]) if isinstance(types, list | tuple) else None]
        for name, mod in layer.named_modules():
            attrs = tuple(
                sorted(
                    (key, value)
                    for key, value in vars(mod).items()
                    if not key.startswith("_")
                    and not any(word in key for word in _INDEX_WORDS)
                    and isinstance(value, int | float | bool | str | type(None))
                )
            )
            parts.append((name, type(mod).__name__, attrs))
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
            parts.append((name, tuple(t.shape), str(t.dtype), t.requires_grad))
        out.append(tuple(parts))
    return out


@_one_at_a_time
def count_parameters(config: dict[str, Any]) -> int:
    """Parameters of the model ``config`` describes, tied ones once (``model.parameters()``),
    built on the ``meta`` device (no memory)."""
    import torch

    with torch.device("meta"):
        model = _build(config, "eager")
    return sum(p.numel() for p in model.parameters())


@_one_at_a_time
def trainable_numels(config: dict[str, Any], job: Training) -> list[int]:
    """Elements of every parameter ``job`` trains on the model ``config`` describes (built on
    the ``meta`` device, its LoRA adapters applied as the recording applies them), in
    ``model.parameters()`` order, tied ones once."""
    import torch

    with torch.device("meta"):
        model = _build(config, "eager")
        if job.lora is not None:
            layers = _layer_list(model, _layers_of(model))[1]
            lora.apply(model, layers, job.lora, torch.float32)
    return [p.numel() for p in model.parameters() if p.requires_grad]


def _to_dtype(model: Any, dtype: Any) -> None:
    """``model.to(dtype)`` (``verify/models/build.py``): floating parameters and buffers
    converted, tied parameters kept tied. Written out because ``Module._apply`` swaps fake
    tensors with ``torch.utils.swap_tensors``, which refuses tensors with weakrefs."""
    import torch

    made: dict[int, Any] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point():
                continue
            if id(p) not in made:
                with torch.no_grad():
                    made[id(p)] = torch.nn.Parameter(p.to(dtype), p.requires_grad)
            module._parameters[name] = made[id(p)]
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_floating_point():
                module._buffers[name] = buf.to(dtype)


def _hooks(model: Any, book: Book, n_layers: int) -> tuple[str, list]:
    """Forward hooks that keep ``book``'s current layer and the layers' sequence spans."""
    import torch

    seq_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr
    prefix, layers = _layer_list(model, n_layers)
    # prepended: a layer's mark comes before FSDP2's pre-forward (its all-gather is the layer's)
    handles = [
        model.register_forward_pre_hook(lambda *_: book.mark_span(seq_nr(), "embed"), prepend=True)
    ]
    base = getattr(model, "base_model", model)
    if base is not model:  # a loop may call the base model alone (chunked-ce)
        handles.append(base.register_forward_pre_hook(lambda *_: book.mark_span(seq_nr(), "embed")))
    for i, layer in enumerate(layers):
        handles.append(
            layer.register_forward_pre_hook(
                lambda *_, i=i: book.mark_span(seq_nr(), i), prepend=True
            )
        )
        handles.append(layer.register_forward_hook(lambda *_: book.mark_span(seq_nr(), "head")))
    return prefix, handles


def _classify_model(book: Book, model: Any, prefix: str) -> None:
    tags = _param_tags(model, prefix)
    named = list(model.named_parameters(remove_duplicate=False))
    for name, p in named + list(model.named_buffers()):
        st = storage_of(p)
        if st is None:
            continue
        sid = book.known(st)
        if sid is None:
            continue
        tag, short = tags[name]
        is_param = any(p is q for _, q in named)
        book.param_of[st._cdata] = (tag, short)
        book.classify(sid, StorageKind.WEIGHT if is_param else StorageKind.BUFFER, short, tag)


def _start(book: Book, model: Any, prefix: str, inputs: tuple) -> None:
    """The measured part starts (verify's ``reset_peak``): what is live now is the baseline."""
    book.drain("base")
    for t in inputs:
        sid = book.known(t.untyped_storage())
        if sid is not None:
            book.classify(sid, StorageKind.INPUT, "input_ids", "base")
    _classify_model(book, model, prefix)
    book.baseline = tuple(sid for sid, _ in book.live.values())
    book.stream = []


def _classify_step(book: Book, optimizer: Any) -> None:
    """Gradients and optimizer states, under their parameter's layer and name."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = storage_of(p)
            named = book.param_of.get(st._cdata) if st is not None else None
            tag, short = named or ("base", "param")
            grad = storage_of(p.grad) if p.grad is not None else None
            if grad is not None:
                sid = book.known(grad)
                if sid is not None:
                    book.classify(sid, StorageKind.GRAD, f"grad:{short}", tag)
            for key, value in optimizer.state.get(p, {}).items():
                found: list = []
                tensors_in(value, found)
                for t in found:
                    state = storage_of(t)
                    sid = book.known(state) if state is not None else None
                    if sid is not None:
                        book.classify(sid, StorageKind.STATE, f"{key}:{short}", tag)


def _optimizer(params: list, job: Training) -> Any:
    """The optimizer verify's hf cases build (``verify/models/optimizers.py``,
    ``_make_factory``): torch.optim with the implementation pinned."""
    import torch

    if job.optimizer in ("adam8bit", "adam32bit"):  # one in-place kernel: calc.derive.bnb
        bits = 8 if job.optimizer == "adam8bit" else 32
        return bnb.bnb_adam_class()(params, bits, job.paged_optimizer)
    foreach, fused = job.optimizer_impl == "foreach", job.optimizer_impl == "fused"
    wd = job.weight_decay
    if job.optimizer == "lion":  # torch has none: calc.derive.lion's, as verify steps it
        return lion.lion_class()(params, lr=1e-4, weight_decay=wd, foreach=foreach)
    if job.optimizer == "adafactor":  # its scalar reads: calc.derive.book._scalar_read
        return torch.optim.Adafactor(params, lr=1e-2, weight_decay=wd, foreach=foreach)
    if job.optimizer in ("sgd", "sgd-momentum"):
        momentum = 0.9 if job.optimizer == "sgd-momentum" else 0.0
        return torch.optim.SGD(
            params, lr=1e-2, momentum=momentum, weight_decay=wd, foreach=foreach, fused=fused
        )
    cls = torch.optim.AdamW if job.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=1e-3, weight_decay=wd, foreach=foreach, fused=fused)


@contextlib.contextmanager
def _sdpa(backend: str) -> Iterator[None]:
    """``sdpa_kernel`` restricted to ``backend`` (``verify/run/step.py``, ``forced_sdpa``)."""
    if backend == "eager":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.MATH
    with sdpa_kernel(chosen):
        yield


def checkpoint_layers(model: Any, every: int, offload: bool = False) -> None:
    """transformers' activation checkpointing on decoder layers ``0, every, 2 every, ...``
    (``activation_checkpointing_enable(every_n_layers=every, offload=offload)``, non-reentrant
    by default in 5.24; verify's ``build_model`` makes the same call). ``offload``: the
    checkpoints' inputs held on the host (`calc.derive.offload`)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(every_n_layers=every, **({"offload": True} if offload else {}))
    elif offload:
        raise DeriveError("offload_activations: this transformers has no offload (5.24 has)")
    elif every == 1:
        model.gradient_checkpointing_enable()
    else:
        raise DeriveError(
            f"recompute_every={every}: this transformers has no every_n_layers "
            "(activation_checkpointing_enable, transformers 5.24)"
        )


def checkpoint_layers_by_op(model: Any) -> None:
    """torchtitan's op-level selective checkpointing on every decoder layer
    (`calc.derive.sac`), through transformers' ``activation_checkpointing_enable``, which hands
    its keyword arguments to ``torch.utils.checkpoint.checkpoint``."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:
        raise DeriveError(
            "recompute='op': this transformers has no activation_checkpointing_kwargs"
        )
    enable(activation_checkpointing_kwargs=sac.checkpoint_kwargs())


def _model_tensors(model: Any) -> list:
    """(name, tensor) of what the built model holds: parameters, buffers and plain tensor
    attributes of its modules (RoPE's ``original_inv_freq``): the storages an eager run made
    while building it and still holds when the measured part starts."""
    import torch

    out: list = list(model.named_parameters(remove_duplicate=False))
    out += list(model.named_buffers())
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not attr.startswith("_"):
                out.append((f"{name}.{attr}", value))
    return out


def _storages(named: Any) -> list[tuple[str, Any]]:
    """``(name, storage)`` of the ``(name, tensor)`` pairs ``named`` that have a storage."""
    return [(name, st) for name, t in named if (st := storage_of(t)) is not None]


def _count_held(book: Book, held: list[tuple[str, Any]]) -> None:
    """Count a built model's storages (``(name, storage)``, `_storages`) from the start of
    ``book``'s recording, as buffers (parameters are classified as weights when the measured
    part starts), also those ``torch.tensor`` made while a rank's model was built in ``book``
    (Gemma's ``embed_scale``), which the book had left out as late: verify's meters count
    every storage of the built model."""
    for name, st in held:
        book.add(st, name, "base", "base", force=True)
        sid = book.known(st)
        if sid is not None:
            book.classify(sid, StorageKind.BUFFER, name, "base")


def _built(config: dict[str, Any], job: Training | Inference, backend: str) -> tuple[Any, Any]:
    """(model, decoder layers) of ``config`` as the job runs it: recomputation, dtype,
    quantized linears, then LoRA's adapters (verify's ``compress.apply`` order), train/eval."""
    import torch

    model = _build(config, "eager" if backend == "eager" else "sdpa")
    if isinstance(job, Training) and job.recompute == "full":
        checkpoint_layers(model, job.recompute_every, job.offload_activations)
    elif isinstance(job, Training) and job.recompute == "op":
        checkpoint_layers_by_op(model)
    dtype = getattr(torch, _WEIGHT_DTYPE[job.precision])
    if dtype != torch.float32:
        _to_dtype(model, dtype)
    layers = _layer_list(model, _layers_of(model))[1]
    if job.quant is not None:  # verify's compress.apply: the linears quantized first
        quantized.apply(model, layers, job.quant)
    if isinstance(job, Training) and job.lora is not None:  # then the adapters
        lora.apply(model, layers, job.lora, dtype)
    model.train(isinstance(job, Training))
    return model, layers


@contextlib.contextmanager
def session(
    config: dict[str, Any], job: Training | Inference, backend: str, shard: Rank | None = None
) -> Iterator[Any]:
    """The model of ``config`` built on fake tensors, in the job's dtype and mode; yields
    ``trace(batch, seq, context) -> Trace`` that records the job at those sizes (each trace
    with fresh inputs, optimizer, caches and bookkeeping; the model's storages counted from
    the start, as when an eager run builds it inside the tracker).

    The model is built once, except for a distributed rank (``shard``: FSDP,
    `calc.derive.sharding`, or transformers' own plans, `calc.derive.native`): FSDP2 makes
    buffers lazily in its first forward and keeps them (at 0 bytes) for later steps, so each
    trace builds and wraps its own model, as each measured run does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # the build, recorded: what an eager build makes outside dispatch is not counted
    # (embed_scale = torch.tensor(..))
    setup = Book()
    compiled = inductor.compiles(job)
    with contextlib.ExitStack() as stack:
        stack.enter_context(RECORDING)  # until the session closes: every trace in it
        if compiled:
            stack.enter_context(inductor.fake_inductor())
        mesh = stack.enter_context(_world(shard))
        stack.enter_context(eager_paths())
        stack.enter_context(quiet())
        stack.enter_context(FakeTensorMode())
        held: list[tuple[str, Any]] = []
        model: Any = None
        owned = shard.params if isinstance(shard, LocalOptimizer) else None
        wrapped = shard is not None and owned is None
        if not wrapped:
            with recorder(setup):
                model, layers = _built(config, job, backend)
                if compiled:
                    inductor.compile_model(model, layers, job)
                # every storage the built model holds, also one made outside dispatch
                # (torch.tensor: Gemma's embed_scale buffer), as verify's meter counts it
                held = _storages(_model_tensors(model))

        def trace(batch: int, seq: int, context: int = 0, steps: int = 2) -> Trace:
            nonlocal model
            book = Book()
            starts: list[int] = []  # generate's forwards, where the stream is cut
            if compiled:  # each point compiled for its own shapes, as each measured run is
                import torch._dynamo

                torch._dynamo.reset()
            offloading = isinstance(job, Training) and job.offload_activations
            with (
                recorder(book, compiled) as mode,
                offload.save_on_host(book) if offloading else contextlib.nullcontext(),
            ):
                if wrapped:
                    assert shard is not None and not isinstance(shard, LocalOptimizer)
                    model = _rank_model(config, job, backend, shard, mesh)
                    _count_held(book, _storages(model.named_buffers()))
                _count_held(book, held)
                if isinstance(job, Training):
                    vocab = _vocab(config)
                    _train(book, mode, model, job, backend, batch, seq, vocab, steps, owned)
                elif job.new_tokens > 0:
                    vocab = _vocab(config)
                    starts = _generate(book, model, job, backend, batch, seq, context, vocab)
                else:
                    _prefill(book, model, job, backend, batch, seq, context, _vocab(config))
            return cut(book.trace(), starts) if context and starts else book.trace()

        yield trace


def _world(rank: Rank | None) -> Any:
    """The fake process group (and meshes) of a distributed rank, nothing for one process or a
    ZeRO-1 rank (its collectives change no sizes)."""
    if isinstance(rank, Native):
        return native_world(rank)
    if isinstance(rank, LocalOptimizer):
        return contextlib.nullcontext()
    return sharding.fake_world(rank)


def _rank_model(
    config: dict[str, Any], job: Training | Inference, backend: str, rank: Any, world: Any
) -> Any:
    """A distributed rank's model: built, wrapped (`_wrap`) and, for a compiled job, each
    decoder layer's ``forward`` compiled after the wrapping (FSDP2's hooks stay outside the
    graphs, as verify's ``verify.dist.profiled`` compiles it)."""
    model, layers = _built(config, job, backend)
    model = _wrap(model, layers, rank, world)
    if inductor.compiles(job):
        inductor.compile_model(model, layers, job)
    return model


def _wrap(model: Any, layers: Any, rank: sharding.Shard | Native, world: Any) -> Any:
    """The model a distributed rank trains: FSDP's wrapping or transformers' own plans."""
    if isinstance(rank, Native):
        return distribute(model, world)
    return sharding.wrap(model, layers, rank, world)


def _layers_of(model: Any) -> int:
    return int(model.config.num_hidden_layers)


def _train(
    book: Book, mode: Any, model: Any, job: Training, backend: str, batch: int, seq: int,
    vocab: int, steps: int = 2, owned: tuple[int, ...] | None = None,
) -> None:  # fmt: skip
    """Two optimizer steps of ``job`` at ``batch`` x ``seq`` tokens (``verify/run/step.py``,
    ``train_two_steps``); ``steps=1``: the first only (`calc.derive.book.second_step_sizes`
    gives the second's sizes from it). ``owned``: the optimizer steps those of the trained
    parameters only (a ZeRO-1 rank, `LocalOptimizer`)."""
    import torch

    ids = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    handles: list[Any] = []
    if inductor.whole_graph(job):  # one graph of every layer: hooks would break it, no tags
        prefix = _layer_list(model, _layers_of(model))[0]
    else:
        prefix, handles = _hooks(model, book, _layers_of(model))
    params = [p for p in model.parameters() if p.requires_grad]
    loss_fn = _loss_fn(model, job)
    if inductor.compiles(job):
        _warm_up(loss_fn, params, job, backend, ids, targets)
    opt = loops.stepper(params, job, lambda ps: _optimizer(ps, job), owned)
    scaler = _scaler() if job.precision == "amp-fp16" else None
    _start(book, model, prefix, (ids, targets))
    with _sdpa(backend):
        _run_steps(book, mode, loss_fn, opt, scaler, params, job, ids, targets, steps)
    _classify_step(book, opt)
    for p in params:
        p.grad = None
    for h in handles:
        h.remove()
    if isinstance(opt, loops.NoStep):
        opt.close()


def _autocast(job: Training) -> Any:
    """The protocol's forward context: ``torch.autocast("cpu")`` to the job's amp dtype, or
    nothing (``verify/run/step.py``, ``micro_batches``)."""
    import torch

    amp = _AUTOCAST.get(job.precision)
    return torch.autocast("cpu", dtype=getattr(torch, amp)) if amp else contextlib.nullcontext()


def _warm_up(
    loss_fn: Any, params: list, job: Training, backend: str, ids: Any, targets: Any
) -> None:
    """verify's warm-up of a compiled model (``verify/run/compiled.py``, ``warm_up``): one
    forward and backward, which compile both graphs, then every gradient set to None and a
    garbage collection; before the measured part starts."""

    with _sdpa(backend):
        with _autocast(job):
            loss = loss_fn(ids, targets)
        loss.backward()
    del loss
    for p in params:
        p.grad = None
    gc.collect()  # as verify's warm-up: what a reference cycle of the compile held goes now


def _loss_fn(model: Any, job: Training) -> Callable[[Any, Any], Any]:
    """The protocol's ``(ids, targets) -> loss``: the model's own loss (``labels=``), or the
    job's loop (`calc.derive.loops.LoopLoss`)."""
    if not loops.is_default_loop(job):
        return loops.LoopLoss(model, job)
    return lambda ids, targets: model(input_ids=ids, labels=targets).loss


def _scaler() -> Any:
    """``torch.amp.GradScaler("cpu")`` whose step does not read ``found_inf``: the real one
    skips ``optimizer.step()`` when ``sum(v.item() for v in found_inf_per_device)`` is nonzero
    (``torch/amp/grad_scaler.py``, ``_maybe_opt_step``), a value fake tensors do not have. The
    recording takes the step, as every measured run does once its scale has settled (a skipped
    step allocates nothing the taken one does not). Unscaling, the ``found_inf`` tensors and
    ``update()`` run as in torch."""
    import torch

    class FiniteScaler(torch.amp.GradScaler):
        def _maybe_opt_step(self, optimizer: Any, optimizer_state: Any, *args: Any, **kw: Any):
            return optimizer.step(*args, **kw)

    return FiniteScaler("cpu")


def _run_steps(
    book: Book, mode: Any, loss_fn: Any, opt: Any, scaler: Any, params: list, job: Training,
    ids: Any, targets: Any, steps: int = 2,
) -> None:  # fmt: skip
    """The loop of ``verify/run/step.py`` (``train_two_steps``, ``micro_batches``)."""

    def zero_grad() -> None:
        _classify_step(book, opt)
        for p in params:
            p.grad = None

    for step in range(1, steps + 1):
        for mb in range(job.grad_accum):
            _mark(book, mode, f"step{step}/forward", opt)
            with _autocast(job):
                loss = loss_fn(ids, targets)
            if scaler is not None:
                loss = scaler.scale(loss)
            if job.zero_grad == "before_backward" and mb == 0:
                zero_grad()
            _mark(book, mode, f"step{step}/backward", opt)
            loss.backward()
            del loss
        _mark(book, mode, f"step{step}/optimizer", opt)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if job.zero_grad == "after_step":
            zero_grad()


def _mark(book: Book, mode: Any, phase: str, opt: Any) -> None:
    book.drain(mode.segment())
    _classify_step(book, opt)
    book.phase = phase
    book.tag_now = "embed" if phase.endswith("forward") else "head"


def _prefill(
    book: Book, model: Any, job: Inference, backend: str, batch: int, prompt: int,
    context: int, vocab: int,
) -> None:  # fmt: skip
    """One prefill of ``prompt`` tokens into a ``StaticCache`` of ``context`` tokens under
    ``no_grad`` with ``logits_to_keep=1`` (``verify/run/step.py``, ``prefill``)."""
    import inspect

    import torch
    import transformers

    ids, masked = _prompts(book, job, batch, prompt, vocab)
    prefix, handles = _hooks(model, book, _layers_of(model))
    _start(book, model, prefix, (ids, *masked.values()))
    book.phase = "prefill"
    book.tag_now = "embed"
    with torch.no_grad(), _sdpa(backend):
        cache = transformers.StaticCache(config=model.config, max_cache_len=context)
        takes = "cache" in inspect.signature(model.forward).parameters
        kw: dict[str, Any] = {"cache": cache} if takes else {"past_key_values": cache}
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw, **masked)
        del out, cache
    for h in handles:
        h.remove()


def _prompts(
    book: Book, job: Inference, batch: int, prompt: int, vocab: int
) -> tuple[Any, dict[str, Any]]:
    """``(ids, masked)``: the prompt ids ``[batch, prompt]`` and the keyword arguments that
    pass their attention mask: for ``padding="left"`` ``{"attention_mask": mask}`` (int64
    ones, the first row's first quarter 0: verify's ``make_prompts``), else none. Both exist
    before the measured part, as the tokenizer's output does. A padded batch sets
    ``book.padded`` (the mask checks read false)."""
    import torch

    ids = torch.randint(0, vocab, (batch, prompt))
    if job.padding == "none":
        return ids, {}
    book.padded = True
    mask = torch.ones(batch, prompt, dtype=torch.long)
    mask[0, : max(prompt // 4, 1)] = 0
    return ids, {"attention_mask": mask}


def _generate(
    book: Book, model: Any, job: Inference, backend: str, batch: int, prompt: int,
    context: int, vocab: int,
) -> list[int]:  # fmt: skip
    """``model.generate`` of ``job.new_tokens`` tokens after ``prompt`` (``context - prompt``
    when ``context`` is given) (``verify/run/step.py``, ``generate``): the decoding
    of `calc.Inference.decoding_kwargs` (greedy, sampling, beams), the prompts' mask of ``job.padding`` (`_prompts`), the cache
    ``job.cache_impl``, token 0 as the eos where the config has none. Phase
    ``prefill`` up to the first forward's end, then ``decode``. Returns the stream index where
    each forward starts (`calc.derive.generate.cut`)."""
    import torch

    new_tokens = context - prompt if context else job.new_tokens
    ids, masked = _prompts(book, job, batch, prompt, vocab)
    prefix, handles = _hooks(model, book, _layers_of(model))
    starts: list[int] = []

    def count(*_: Any) -> None:
        book.drain(book.tag_now)
        starts.append(len(book.stream))
        if len(starts) > 1:
            book.phase = "decode"

    handles.append(model.register_forward_pre_hook(count))
    handles.append(model.register_forward_hook(lambda _m, _a, out: _file_cache(book, out)))
    kw: dict[str, Any] = {"cache_implementation": "static"} if job.cache_impl == "static" else {}
    # a cache, as a checkpoint's generation_config.json gives it (GenerationConfig's default):
    # built from a config.json with "use_cache": false, generate would run without one
    kw["use_cache"] = True
    if model.generation_config.eos_token_id is None:
        kw["eos_token_id"] = 0
    # a static cache is sized for the longest of the model's generate calls (generation/
    # utils.py:2184-2215): each recording starts as a fresh model's first call
    vars(model).pop("_previous_max_cache_length", None)
    kw.update(masked)
    _start(book, model, prefix, (ids, *masked.values()))
    book.phase = "prefill"
    book.tag_now = "embed"
    with torch.no_grad(), _sdpa(backend), stop_after(prompt, new_tokens, book.answers):
        kw.update(job.decoding_kwargs())  # greedy, sampling, beams
        out = model.generate(ids, max_new_tokens=new_tokens, **kw)
        del out
    for h in handles:
        h.remove()
    return starts


def _file_cache(book: Book, out: Any) -> None:
    """The tensors of the cache a forward returns (``out.cache``, each layer's keys and values)
    filed as KV cache (under the layer that made them)."""
    cache = out.get("cache") if hasattr(out, "get") else None
    cache = cache if cache is not None else getattr(out, "past_key_values", None)
    for layer in getattr(cache, "layers", ()):
        found: list = []
        tensors_in(list(vars(layer).values()), found)
        for t in found:
            st = storage_of(t)
            sid = book.known(st) if st is not None else None
            if sid is not None:
                book.classify(sid, StorageKind.KV_CACHE, "kv_cache", book.tag[sid])
