"""Recording what the real modeling code allocates and frees, on fake tensors.

The model ``transformers`` builds from the config (``AutoModelForCausalLM.from_config``) runs
the protocol of verify's hf cases (``verify/run/step.py``: two optimizer steps of
``grad_accum`` micro-batches; or one prefill into a ``StaticCache``) under
``torch._subclasses.fake_tensor.FakeTensorMode``: every tensor has its shape, dtype and storage
size, and no memory. A dispatch mode with the rules of verify's CPU storage tracker
(``verify/measure/tracker.py``) follows the storages:

* an allocation is a new storage among an op's outputs; a free is a weakref callback on the
  Python ``UntypedStorage`` (kept alive exactly as long as the ``StorageImpl``, fake ones too),
  queued and applied before the next op is accounted, as the tracker does;
* a storage first seen as an op input is not counted ("late"); nor is the output of
  ``aten.lift_fresh`` (``torch.tensor()`` of a Python number, which bypasses dispatch in an
  eager run: the optimizers' ``step`` scalars), nor an empty storage;
* autograd's saved tensors are seen through ``saved_tensors_hooks``, as the tracker installs
  them (the pack hook returns a detached alias, like the tracker's).

Each storage is tagged with the decoder layer that allocated it: forward pre/post hooks on the
layers in the forward; in the backward, the layer of the autograd node running
(``torch._C._current_autograd_node``), known from the sequence numbers the layers' forwards
spanned (``torch._C._autograd._get_sequence_nr``); in the optimizer step, the layer of the
parameter the op works on. Parameters, gradients and optimizer states carry their parameter's
layer.

torch and transformers are imported only inside these functions: ``calc`` imports without them.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from calc.config.jobs import Inference, Training
from calc.replay.kinds import StorageKind

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

_WEIGHT_DTYPE = {
    "fp32": "float32",
    "amp-bf16": "float32",
    "amp-fp16": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
}
"""The weights' dtype of each precision (``verify/models/build.py``, ``WEIGHT_DTYPE``)."""
_AUTOCAST = {"amp-bf16": "bfloat16", "amp-fp16": "float16"}
_SKIPPED_OPS = ("lift_fresh", "lift_fresh_copy")
"""Ops whose outputs an eager run makes outside dispatch (``torch.tensor()``)."""


@dataclass(frozen=True, slots=True)
class Trace:
    """One recorded run at one (batch, sequence[, context]) point."""

    nbytes: tuple[int, ...]
    """Raw bytes of every storage seen, by storage number."""
    info: tuple[tuple[str, str, object], ...]
    """(kind, name, layer tag) of every storage, by storage number."""
    baseline: tuple[int, ...]
    """Storages alive when the measured part starts (weights, buffers, inputs)."""
    stream: tuple[tuple[bool, int, str, object], ...]
    """(allocation?, storage number, phase, segment) of every event, in order."""

    def structure(self) -> tuple:
        """Everything but the sizes: two points share a structure when this is equal."""
        return (self.info, self.baseline, self.stream)


class DeriveError(Exception):
    """The modeling code could not be built or run on fake tensors (the message says where)."""


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


def _tensors(obj: Any, out: list) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, list | tuple):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)


def _storage(t: Any) -> Any | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


_KIND_RANK = {
    StorageKind.WEIGHT: 0,
    StorageKind.BUFFER: 0,
    StorageKind.GRAD: 1,
    StorageKind.STATE: 2,
    StorageKind.INPUT: 3,
}


class _Book:
    """The storages seen and the event stream (the dispatch mode's state)."""

    def __init__(self) -> None:
        self.nbytes: list[int] = []
        self.kind: list[str] = []
        self.name: list[str] = []
        self.tag: list[object] = []
        self.saved: set[int] = set()
        self.live: dict[int, tuple[int, weakref.ref]] = {}
        self.ignored: dict[int, weakref.ref] = {}
        self.pending: collections.deque = collections.deque()
        self.stream: list[tuple[bool, int, str, object]] = []
        self.baseline: tuple[int, ...] = ()
        self.phase = "setup"
        self.tag_now: object = "base"
        self.starts: list[int] = []
        self.start_tags: list[object] = []
        self.param_of: dict[int, tuple[object, str]] = {}
        """storage key -> (tag, parameter name) for parameters and buffers."""

    def drain(self, segment: object) -> None:
        """Apply the queued frees, in storage order: the order in which Python destroys the
        objects of one batch (a dict of outputs going away) is not the code's, and frees
        between two allocations cannot change a peak."""
        freed = []
        while self.pending:
            key, ref = self.pending.popleft()
            entry = self.live.get(key)
            if entry is not None and entry[1] is ref:
                del self.live[key]
                freed.append(entry[0])
            elif self.ignored.get(key) is ref:
                del self.ignored[key]
        self.stream.extend((False, sid, self.phase, segment) for sid in sorted(freed))

    def _ref(self, st: Any, key: int) -> weakref.ref:
        append = self.pending.append

        def dead(ref: weakref.ref) -> None:
            append((key, ref))

        return weakref.ref(st, dead)

    def known(self, st: Any) -> int | None:
        """The storage number of a live counted storage, else None."""
        entry = self.live.get(st._cdata)
        if entry is not None and entry[1]() is st:
            return entry[0]
        return None

    def ignore(self, st: Any) -> None:
        key = st._cdata
        if self.known(st) is None:
            ref = self.ignored.get(key)
            if ref is None or ref() is not st:
                self.ignored[key] = self._ref(st, key)

    def add(self, st: Any, name: str, tag: object, segment: object) -> None:
        key = st._cdata
        entry = self.live.get(key)
        if entry is not None:
            if entry[1]() is st:
                return
            del self.live[key]
            self.stream.append((False, entry[0], self.phase, segment))
        ref = self.ignored.get(key)
        if ref is not None:
            if ref() is st:
                return
            del self.ignored[key]
        raw = st.nbytes()
        if raw == 0:
            self.ignored[key] = self._ref(st, key)
            return
        sid = len(self.nbytes)
        self.nbytes.append(raw)
        self.kind.append(StorageKind.ACT)
        self.name.append(name)
        self.tag.append(tag)
        self.live[key] = (sid, self._ref(st, key))
        self.stream.append((True, sid, self.phase, segment))

    def resized(self, st: Any, name: str, segment: object) -> None:
        """A mutating op changed a storage's size: the old one freed, a new one counted."""
        sid = self.known(st)
        if sid is None or st.nbytes() == self.nbytes[sid]:
            return
        del self.live[st._cdata]
        self.stream.append((False, sid, self.phase, segment))
        self.add(st, name, self.tag[sid], segment)

    def see_inputs(self, args: Any, kwargs: Any, name: str, mutable: bool, seg: object) -> None:
        """Inputs never seen are late (not counted); a mutating op may have resized one."""
        ins: list = []
        _tensors(args, ins)
        _tensors(kwargs, ins)
        for t in ins:
            st = _storage(t)
            if st is None:
                continue
            if self.known(st) is None:
                self.ignore(st)
            elif mutable:
                self.resized(st, name, seg)

    def see_outputs(self, out: Any, args: Any, kwargs: Any, name: str, seg: object) -> None:
        """New storages among the outputs, tagged with the layer (in the optimizer step: the
        layer of the parameter the output belongs to)."""
        outs: list = []
        _tensors(out, outs)
        skip = name.split(".")[0] in _SKIPPED_OPS
        optimizer = self.phase.endswith("optimizer")
        for j, t in enumerate(outs):
            st = _storage(t)
            if st is None:
                continue
            if skip:
                self.ignore(st)
                continue
            tag = seg
            if optimizer:
                found = _op_tag(self, args, kwargs, j, len(outs))
                tag = found if found is not None else "optimizer"
            self.add(st, name, tag, tag if optimizer else seg)

    def classify(self, sid: int, kind: StorageKind, name: str, tag: object) -> None:
        old = _KIND_RANK.get(StorageKind(self.kind[sid]), 9)
        if _KIND_RANK[kind] <= old:
            self.kind[sid], self.name[sid], self.tag[sid] = kind, name, tag

    def node_tag(self, node: Any) -> object:
        """The layer of an autograd node: its parameter's for AccumulateGrad, else the layer
        whose forward span holds its sequence number."""
        variable = getattr(node, "variable", None)
        if variable is not None:
            st = _storage(variable)
            if st is not None and st._cdata in self.param_of:
                return self.param_of[st._cdata][0]
            return "base"
        i = bisect.bisect_right(self.starts, node._sequence_nr()) - 1
        return self.start_tags[i] if i >= 0 else "base"

    def mark_span(self, seq: int, tag: object) -> None:
        self.starts.append(seq)
        self.start_tags.append(tag)
        self.tag_now = tag

    def trace(self) -> Trace:
        kinds = [
            StorageKind.SAVED if k == StorageKind.ACT and sid in self.saved else k
            for sid, k in enumerate(self.kind)
        ]
        info = tuple((str(k), n, t) for k, n, t in zip(kinds, self.name, self.tag, strict=True))
        return Trace(tuple(self.nbytes), info, self.baseline, tuple(self.stream))


def _op_tag(book: _Book, args: Any, kwargs: Any, index: int, n_out: int) -> object | None:
    """In the optimizer step: the layer of the parameter-like input the ``index``-th output
    belongs to (the same position of a ``_foreach_*`` list, else the first tagged input)."""
    candidates: list = []
    for arg in (*args, *(kwargs or {}).values()):
        if isinstance(arg, list | tuple) and len(arg) == n_out and n_out > 1:
            candidates.append(arg[index])
        else:
            _tensors(arg, candidates)
    for t in candidates:
        st = _storage(t) if t is not None and hasattr(t, "untyped_storage") else None
        if st is None:
            continue
        sid = book.known(st)
        if sid is not None and isinstance(book.tag[sid], int):
            return book.tag[sid]
    return None


def _scalar_read(t: Any) -> bool:
    """A Python value read from a fake tensor (``bool(x)``, ``x.item()``), as the eager run
    reads it: the modeling code asks such questions of boolean checks on its own index tensors
    (``masking_utils``: "no packed sequences?", "no padding?"), which are true for the
    unpadded, unpacked batches of the protocol. Any other read cannot be answered."""
    import torch

    if t.dtype == torch.bool:
        return True
    raise DeriveError(
        f"the modeling code reads a value of a {t.dtype} tensor (aten._local_scalar_dense): "
        "its sizes depend on data the derived replay does not have"
    )


def _mode_type() -> type:
    """The dispatch mode class (made on first use: it subclasses torch's ``TorchDispatchMode``)."""
    import torch
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self, book: _Book) -> None:
            super().__init__()
            self.book = book
            self.names: dict[Any, tuple[str, bool]] = {}

        def segment(self) -> object:
            node = torch._C._current_autograd_node()
            return self.book.node_tag(node) if node is not None else self.book.tag_now

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            if func is torch.ops.aten._local_scalar_dense.default:
                try:  # a constant the fake mode knows (torch.tensor(0.0): Adam's step)
                    return func(*args, **(kwargs or {}))
                except DataDependentOutputException:
                    return _scalar_read(args[0])
            out = func(*args, **(kwargs or {}))
            info = self.names.get(func)
            if info is None:
                schema = getattr(func, "_schema", None)
                info = (
                    getattr(func, "__name__", str(func)).removesuffix(".default"),
                    bool(schema is not None and schema.is_mutable),
                )
                self.names[func] = info
            name, mutable = info
            seg = self.segment()
            self.book.drain(seg)
            self.book.see_inputs(args, kwargs, name, mutable, seg)
            self.book.see_outputs(out, args, kwargs, name, seg)
            return out

    return Recorder


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch's fake-tensor logger off: a failing op is reported once, by `DeriveError`."""
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _eager_paths() -> Iterator[None]:
    """transformers takes its tracing paths for fake tensors (``is_tracing`` in
    ``transformers/utils/import_utils.py`` counts a FakeTensor as tracing; ``masking_utils``
    then builds the causal mask that an eager run skips for SDPA's ``is_causal``): while
    recording, ``is_fake_tensor`` answers as for the eager tensors the run stands for."""
    from transformers.utils import import_utils

    original = import_utils.is_fake_tensor
    import_utils.is_fake_tensor = lambda x: False
    try:
        yield
    finally:
        import_utils.is_fake_tensor = original


def _vocab(config: dict[str, Any]) -> int:
    return int(config["vocab_size"])


def first_sentence(text: str, limit: int = 240) -> str:
    """The first line of an error, up to its first sentence and ``limit`` characters (some
    list every model type transformers knows)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    head = line.split(". ")[0]
    return head if len(head) <= limit else head[: limit - 3] + "..."


def _build(config: dict[str, Any], attention: str) -> Any:
    """``AutoModelForCausalLM.from_config`` of ``config``; any failure is a `DeriveError` naming
    the model type and what transformers said."""
    import torch
    import transformers

    fields = dict(config)
    model_type = fields.pop("model_type")
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **fields)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attention)
    except Exception as exc:  # transformers raises many kinds; one message for the user
        raise DeriveError(
            f"transformers {transformers.__version__} cannot build model_type={model_type!r} "
            f"as AutoModelForCausalLM: {type(exc).__name__}: {first_sentence(str(exc))}"
        ) from exc


def layer_types(config: dict[str, Any]) -> list[str]:
    """The per-layer kinds transformers' config object holds (``layer_types``: what the config
    class builds when the config.json has none, e.g. Gemma-2's alternating sliding and full
    attention), or ``[]`` when it has none."""
    import transformers

    fields = dict(config)
    model_type = fields.pop("model_type")
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # one message, as for the build
        raise DeriveError(
            f"transformers {transformers.__version__} cannot read a config of "
            f"model_type={model_type!r}: {type(exc).__name__}: {first_sentence(str(exc))}"
        ) from exc
    types = getattr(cfg, "layer_types", None)
    return [str(t) for t in types] if isinstance(types, list | tuple) else []


def count_parameters(config: dict[str, Any]) -> int:
    """Parameters of the model ``config`` describes, tied ones once (``model.parameters()``),
    built on the ``meta`` device (no memory)."""
    import torch

    with torch.device("meta"):
        model = _build(config, "eager")
    return sum(p.numel() for p in model.parameters())


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


def _hooks(model: Any, book: _Book, n_layers: int) -> tuple[str, list]:
    """Forward hooks that keep ``book``'s current layer and the layers' sequence spans."""
    import torch

    seq_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr
    prefix, layers = _layer_list(model, n_layers)
    handles = [model.register_forward_pre_hook(lambda *_: book.mark_span(seq_nr(), "embed"))]
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda *_, i=i: book.mark_span(seq_nr(), i)))
        handles.append(layer.register_forward_hook(lambda *_: book.mark_span(seq_nr(), "head")))
    return prefix, handles


def _classify_model(book: _Book, model: Any, prefix: str) -> None:
    tags = _param_tags(model, prefix)
    named = list(model.named_parameters(remove_duplicate=False))
    for name, p in named + list(model.named_buffers()):
        st = _storage(p)
        if st is None:
            continue
        sid = book.known(st)
        if sid is None:
            continue
        tag, short = tags[name]
        is_param = any(p is q for _, q in named)
        book.param_of[st._cdata] = (tag, short)
        book.classify(sid, StorageKind.WEIGHT if is_param else StorageKind.BUFFER, short, tag)


def _start(book: _Book, model: Any, prefix: str, inputs: tuple) -> None:
    """The measured part starts (verify's ``reset_peak``): what is live now is the baseline."""
    book.drain("base")
    for t in inputs:
        sid = book.known(t.untyped_storage())
        if sid is not None:
            book.classify(sid, StorageKind.INPUT, "input_ids", "base")
    _classify_model(book, model, prefix)
    book.baseline = tuple(sid for sid, _ in book.live.values())
    book.stream = []


def _classify_step(book: _Book, optimizer: Any) -> None:
    """Gradients and optimizer states, under their parameter's layer and name."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            tag, short = book.param_of.get(p.untyped_storage()._cdata, ("base", "param"))
            if p.grad is not None:
                sid = book.known(p.grad.untyped_storage())
                if sid is not None:
                    book.classify(sid, StorageKind.GRAD, f"grad:{short}", tag)
            for key, value in optimizer.state.get(p, {}).items():
                found: list = []
                _tensors(value, found)
                for t in found:
                    sid = book.known(t.untyped_storage())
                    if sid is not None:
                        book.classify(sid, StorageKind.STATE, f"{key}:{short}", tag)


def _optimizer(params: list, job: Training) -> Any:
    """The optimizer verify's hf cases build (``verify/models/optimizers.py``,
    ``_make_factory``): torch.optim with the implementation pinned."""
    import torch

    foreach, fused = job.optimizer_impl == "foreach", job.optimizer_impl == "fused"
    wd = job.weight_decay
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


@contextlib.contextmanager
def session(config: dict[str, Any], job: Training | Inference, backend: str) -> Iterator[Any]:
    """The model of ``config`` built once on fake tensors, in the job's dtype and mode; yields
    ``trace(batch, seq, context) -> Trace`` that records the job at those sizes (each trace
    with fresh inputs, optimizer, caches and bookkeeping; the model's storages counted from
    the start, as when an eager run builds it inside the tracker)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    training = isinstance(job, Training)
    setup = _Book()  # the build, recorded: what an eager build makes outside dispatch is not
    with _eager_paths(), _quiet(), FakeTensorMode():  # counted (embed_scale = torch.tensor(..))
        with _recorder(setup):
            model = _build(config, "eager" if backend == "eager" else "sdpa")
            if isinstance(job, Training) and job.recompute == "full":
                enable = getattr(model, "activation_checkpointing_enable", None)
                (enable or model.gradient_checkpointing_enable)()
            dtype = getattr(torch, _WEIGHT_DTYPE[job.precision])
            if dtype != torch.float32:
                _to_dtype(model, dtype)
            model.train(training)
            held = [
                (name, t)
                for name, t in _model_tensors(model)
                if (st := _storage(t)) is not None and setup.known(st) is not None
            ]

        def trace(batch: int, seq: int, context: int = 0) -> Trace:
            book = _Book()
            with _recorder(book) as mode:
                for name, t in held:
                    st = _storage(t)
                    if st is not None:
                        book.add(st, name, "base", "base")
                        sid = book.known(st)
                        if sid is not None:
                            book.classify(sid, StorageKind.BUFFER, name, "base")
                if isinstance(job, Training):
                    _train(book, mode, model, job, backend, batch, seq, _vocab(config))
                else:
                    _prefill(book, model, job, backend, batch, seq, context, _vocab(config))
            return book.trace()

        yield trace


@contextlib.contextmanager
def _recorder(book: _Book) -> Iterator[Any]:
    """The recorder over ``book``, with the saved-tensor hooks the tracker installs."""
    import torch

    def pack(t: Any) -> Any:
        st = _storage(t)
        if st is not None:
            sid = book.known(st)
            if sid is not None:
                book.saved.add(sid)
        return t.detach()

    with _mode_type()(book) as mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield mode
        book.drain(book.tag_now)


def _layers_of(model: Any) -> int:
    return int(model.config.num_hidden_layers)


def _train(
    book: _Book, mode: Any, model: Any, job: Training, backend: str, batch: int, seq: int,
    vocab: int,
) -> None:  # fmt: skip
    """Two optimizer steps of ``job`` at ``batch`` x ``seq`` tokens (``verify/run/step.py``,
    ``train_two_steps``)."""
    import torch

    ids = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    prefix, handles = _hooks(model, book, _layers_of(model))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(params, job)
    scaler = torch.amp.GradScaler("cpu") if job.precision == "amp-fp16" else None
    _start(book, model, prefix, (ids, targets))
    with _sdpa(backend):
        _run_steps(book, mode, model, opt, scaler, params, job, ids, targets)
    _classify_step(book, opt)
    for p in params:
        p.grad = None
    for h in handles:
        h.remove()


def _run_steps(
    book: _Book, mode: Any, model: Any, opt: Any, scaler: Any, params: list, job: Training,
    ids: Any, targets: Any,
) -> None:  # fmt: skip
    """The loop of ``verify/run/step.py`` (``train_two_steps``, ``micro_batches``)."""
    import torch

    amp = _AUTOCAST.get(job.precision)

    def zero_grad() -> None:
        _classify_step(book, opt)
        for p in params:
            p.grad = None

    for step in (1, 2):
        for mb in range(job.grad_accum):
            _mark(book, mode, f"step{step}/forward", opt)
            ctx = (
                torch.autocast("cpu", dtype=getattr(torch, amp))
                if amp
                else contextlib.nullcontext()
            )
            with ctx:
                loss = model(input_ids=ids, labels=targets).loss
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


def _mark(book: _Book, mode: Any, phase: str, opt: Any) -> None:
    book.drain(mode.segment())
    _classify_step(book, opt)
    book.phase = phase
    book.tag_now = "embed" if phase.endswith("forward") else "head"


def _prefill(
    book: _Book, model: Any, job: Inference, backend: str, batch: int, prompt: int,
    context: int, vocab: int,
) -> None:  # fmt: skip
    """One prefill of ``prompt`` tokens into a ``StaticCache`` of ``context`` tokens under
    ``no_grad`` with ``logits_to_keep=1`` (``verify/run/step.py``, ``prefill``)."""
    import inspect

    import torch
    import transformers

    ids = torch.randint(0, vocab, (batch, prompt))
    prefix, handles = _hooks(model, book, _layers_of(model))
    _start(book, model, prefix, (ids,))
    book.phase = "prefill"
    book.tag_now = "embed"
    with torch.no_grad(), _sdpa(backend):
        cache = transformers.StaticCache(config=model.config, max_cache_len=context)
        takes = "cache" in inspect.signature(model.forward).parameters
        kw = {"cache": cache} if takes else {"past_key_values": cache}
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw)
        del out, cache
    for h in handles:
        h.remove()
