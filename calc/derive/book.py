"""The bookkeeping of a recording: storages, their layers and kinds, the event stream.

`Book` follows storages with the rules of verify's CPU storage tracker
(``verify/measure/tracker.py``), through a dispatch mode (`mode_type`):

* an allocation is a new storage among an op's outputs; a free is a weakref callback on the
  Python ``UntypedStorage`` (kept alive exactly as long as the ``StorageImpl``, fake ones too),
  queued and applied before the next op is accounted, as the tracker does;
* a storage first seen as an op input is not counted ("late"); nor is the output of
  ``aten.lift_fresh`` (``torch.tensor()`` of a Python number, which bypasses dispatch in an
  eager run: the optimizers' ``step`` scalars), nor an empty storage;
* autograd's saved tensors are seen through ``saved_tensors_hooks``, as the tracker installs
  them (the pack hook returns a detached alias, like the tracker's).

Each storage is tagged with the decoder layer that allocated it: the layer whose forward is
running (kept by `calc.derive.record`'s hooks); in the backward, the layer of the autograd node
running (``torch._C._current_autograd_node``), known from the sequence numbers the layers'
forwards spanned (``torch._C._autograd._get_sequence_nr``); in the optimizer step, the layer of
the parameter the op works on.

torch and transformers are imported only inside these functions: ``calc`` imports without them.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from calc.replay.kinds import StorageKind

SKIPPED_OPS = ("lift_fresh", "lift_fresh_copy")
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


def second_step_sizes(full: Trace, one: Trace) -> tuple[int, ...] | None:
    """The bytes of ``full``'s storages (two optimizer steps recorded) at the sizes ``one``
    was recorded at (the first step only): the first step's storages from ``one``, each of
    the second step's from its counterpart in the first (allocated in the same phase, with
    the same kind, name and layer, the same rank among those; the second step repeats the
    first's forward and backward). None when ``one`` did not record ``full``'s first step
    (its storages and events up to the second step), or when a counterpart's bytes differ
    in ``full`` (then record both steps)."""
    phase_of: dict[int, str] = {}
    for alloc, sid, phase, _seg in full.stream:
        if alloc:
            phase_of.setdefault(sid, phase)
    later = [sid for sid, phase in phase_of.items() if not phase.startswith("step1/")]
    first = min(later, default=len(full.nbytes))
    cut = next((i for i, e in enumerate(full.stream) if e[2].startswith("step2/")), 0)
    start = cut  # the frees applied as the second step starts; ``one`` ends with more
    while start > 0 and not full.stream[start - 1][0]:
        start -= 1
    ok = one.stream[:start] == full.stream[:start]
    ok = ok and set(full.stream[start:cut]) <= set(one.stream[start:])
    if not ok or len(one.nbytes) != first or one.info != full.info[:first]:
        return None
    ranks: dict[tuple, list[int]] = {}
    for sid in range(first):
        if phase_of.get(sid, "").startswith("step1/"):
            ranks.setdefault((phase_of[sid][6:], full.info[sid]), []).append(sid)
    seen: collections.Counter = collections.Counter()
    sizes = list(one.nbytes)
    for sid in range(first, len(full.nbytes)):
        phase = phase_of.get(sid, "")
        key = (phase[6:], full.info[sid])
        pool, rank = ranks.get(key, []), seen[key]
        seen[key] += 1
        if not phase.startswith("step2/") or rank >= len(pool):
            return None
        if full.nbytes[pool[rank]] != full.nbytes[sid]:
            return None
        sizes.append(one.nbytes[pool[rank]])
    return tuple(sizes)


class DeriveError(Exception):
    """The modeling code could not be built or run on fake tensors (the message says where)."""


def tensors_in(obj: Any, out: list) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, list | tuple):
        for o in obj:
            tensors_in(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            tensors_in(o, out)


def storage_of(t: Any) -> Any | None:
    """The storage holding ``t``'s data: a DTensor's (FSDP2's sharded parameters, their
    gradients and optimizer states) is its local tensor's, as the tracker unwraps it."""
    t = getattr(t, "_local_tensor", t)
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
    StorageKind.KV_CACHE: 4,
}


class Book:
    """The storages seen and the event stream (the dispatch mode's state)."""

    def __init__(self) -> None:
        self.nbytes: list[int] = []
        self.kind: list[str] = []
        self.name: list[str] = []
        self.tag: list[object] = []
        self.saved: set[int] = set()
        self.live: dict[int, tuple[int, weakref.ref]] = {}
        self.ignored: dict[int, weakref.ref] = {}
        self.empty: dict[int, weakref.ref] = {}
        """Storages counted with 0 bytes (the tracker keeps them, at 0 B, until a resize)."""
        self.pending: collections.deque = collections.deque()
        self.stream: list[tuple[bool, int, str, object]] = []
        self.baseline: tuple[int, ...] = ()
        self.phase = "setup"
        self.tag_now: object = "base"
        self.starts: list[int] = []
        self.start_tags: list[object] = []
        self.param_of: dict[int, tuple[object, str]] = {}
        """storage key -> (tag, parameter name) for parameters and buffers."""
        self.on_host = False
        """Ops run now make host copies (activation offloading's pack hook, `host`): their
        outputs are not the device's."""
        self.answers: list[int] = []
        """Integer reads to answer, in order (generate's crop after a beam search,
        `calc.derive.generate.stop_after`)."""
        self.padded = False
        """The prompts are left-padded (``Inference(padding="left")``): the boolean checks on
        the attention mask answer "some token is masked" (`_scalar_read`)."""

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
            elif self.empty.get(key) is ref:
                del self.empty[key]
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

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """What runs inside makes pinned host memory (a pack hook's copy): not counted, as the
        tracker does not count verify's copies (``verify/models/offload.py``)."""
        self.on_host = True
        try:
            yield
        finally:
            self.on_host = False

    def ignore(self, st: Any) -> None:
        key = st._cdata
        if self.known(st) is None:
            ref = self.ignored.get(key)
            if ref is None or ref() is not st:
                self.ignored[key] = self._ref(st, key)

    def add(self, st: Any, name: str, tag: object, segment: object, force: bool = False) -> None:
        """Count storage ``st`` from now on (once). ``force``: also one the book has left out
        as late (a ``torch.tensor`` made while recording), as verify's meters count a built
        model's every storage."""
        key = st._cdata
        entry = self.live.get(key)
        if entry is not None:
            if entry[1]() is st:
                return
            del self.live[key]
            self.stream.append((False, entry[0], self.phase, segment))
        for pool in (self.ignored, self.empty):
            ref = pool.get(key)
            if ref is not None:
                if ref() is st and not (force and pool is self.ignored):
                    return
                del pool[key]
        raw = st.nbytes()
        if raw == 0:
            self.empty[key] = self._ref(st, key)
            return
        sid = len(self.nbytes)
        self.nbytes.append(raw)
        self.kind.append(StorageKind.ACT)
        self.name.append(name)
        self.tag.append(tag)
        self.live[key] = (sid, self._ref(st, key))
        self.stream.append((True, sid, self.phase, segment))

    def resized(self, st: Any, name: str, segment: object) -> None:
        """A mutating op or ``UntypedStorage.resize_`` changed a storage's size: the old one
        freed, a new one counted (FSDP2's unsharded parameters and all-gather outputs come
        and go as ``resize_`` of storages counted at 0 bytes, `empty`)."""
        key = st._cdata
        ref = self.empty.get(key)
        if ref is not None and ref() is st:
            if st.nbytes() > 0:
                del self.empty[key]
                self.add(st, name, segment, segment)
            return
        sid = self.known(st)
        if sid is None or st.nbytes() == self.nbytes[sid]:
            return
        del self.live[key]
        self.stream.append((False, sid, self.phase, segment))
        self.add(st, name, self.tag[sid], segment)

    def see_inputs(self, args: Any, kwargs: Any, name: str, mutable: bool, seg: object) -> None:
        """Inputs never seen are late (not counted); a mutating op may have resized one."""
        ins: list = []
        tensors_in(args, ins)
        tensors_in(kwargs, ins)
        for t in ins:
            st = storage_of(t)
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
        tensors_in(out, outs)
        skip = name.split(".")[0] in SKIPPED_OPS
        optimizer = self.phase.endswith("optimizer")
        for j, t in enumerate(outs):
            st = storage_of(t)
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
            st = storage_of(variable)
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


def _op_tag(book: Book, args: Any, kwargs: Any, index: int, n_out: int) -> object | None:
    """In the optimizer step: the layer of the parameter-like input the ``index``-th output
    belongs to (the same position of a ``_foreach_*`` list, else the first tagged input)."""
    candidates: list = []
    for arg in (*args, *(kwargs or {}).values()):
        if isinstance(arg, list | tuple) and len(arg) == n_out and n_out > 1:
            candidates.append(arg[index])
        else:
            tensors_in(arg, candidates)
    for t in candidates:
        st = storage_of(t) if t is not None and hasattr(t, "untyped_storage") else None
        if st is None:
            continue
        sid = book.known(st)
        if sid is not None and isinstance(book.tag[sid], int):
            return book.tag[sid]
    return None


def _scalar_read(
    t: Any, phase: str, padded: bool = False, answers: list[int] | None = None
) -> bool | float | int:
    """A Python value read from a fake tensor (``bool(x)``, ``x.item()``), as the eager run
    reads it: the modeling code asks such questions of boolean checks on its own index tensors
    (``masking_utils``: "no packed sequences?", "no padding?"), which are true for the
    unpadded, unpacked batches of the protocol. With ``padded`` (a left-padded batch) every
    boolean read answers false, as in the eager run (transformers 5.24, measured on llama: the
    mask checks of ``generate`` (``generation/utils.py``: "mask all ones?" at 2899, "right
    padding?" at 2862, the eos/pad checks at 2413 and 2421) and of ``masking_utils.
    _ignore_causal_mask_sdpa`` (lines 292 and 298) all read false; generate's stop check is
    answered apart, `calc.derive.generate.stop_after`). In the optimizer step a floating-point read is
    a scalar factor that sizes nothing (``torch.optim.Adafactor`` reads its step count and the
    parameter and update norms as Python numbers: ``torch/optim/_adafactor.py``, ``step_t.item()``,
    ``param.norm(2).item()``): 1.0 stands for it. An integer read takes the next of
    ``answers`` (`Book.answers`) when there is one (the crop after a beam search). Any other
    read cannot be answered."""
    import torch

    if t.dtype == torch.bool:
        return not padded
    if answers and not t.dtype.is_floating_point:
        return answers.pop(0)
    if phase.endswith("/optimizer") and t.dtype.is_floating_point:
        return 1.0
    raise DeriveError(
        f"the modeling code reads a value of a {t.dtype} tensor (aten._local_scalar_dense): "
        "its sizes depend on data the derived replay does not have"
    )


def grouped_mm_fake(args: Any, kwargs: Any) -> Any:
    """The output of ``aten._grouped_mm`` for inputs that are not bf16, on fake tensors.

    torch's meta rule (``torch/_meta_registrations.py``, ``_meta_grouped_mm_common``) checks
    the CUDA kernel's dtype (bf16 only) and refuses fp32, while the CPU kernel the tracked
    run takes accepts it (transformers' ``integrations/moe.py``, ``_can_use_grouped_mm``: on
    CPU any dtype from torch 2.9, 16-byte aligned data up to 2.10). The output is
    the meta rule's (``_create_grouped_mm_output_tensor`` without CUDA's row padding): 2-D x
    3-D gives ``[rows, n]``, 3-D x 2-D ``[m, n]``, 2-D x 2-D one ``[m, n]`` per group, 3-D x
    3-D a batched product; contiguous, of the first input's dtype unless ``out_dtype``."""
    import torch

    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    given = dict(zip(names, args, strict=False)) | dict(kwargs or {})
    a, b, offs = given["mat_a"], given["mat_b"], given["offs"]
    if a.dim() == 2 and b.dim() == 2:
        size = [offs.size(0), a.size(0), b.size(1)]
    elif a.dim() == 2:
        size = [a.size(0), b.size(-1)]
    elif b.dim() == 2:
        size = [a.size(1), b.size(1)]
    else:
        size = [a.size(0), a.size(1), b.size(-1)]
    dtype = given.get("out_dtype") or a.dtype
    return torch.empty(size, dtype=dtype, device=a.device)


def mode_type() -> type:
    """The dispatch mode class (made on first use: it subclasses torch's ``TorchDispatchMode``)."""
    import torch
    import torch.distributed._functional_collectives
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.utils._python_dispatch import TorchDispatchMode

    wait_tensor = torch.ops._c10d_functional.wait_tensor.default

    class Recorder(TorchDispatchMode):
        def __init__(self, book: Book) -> None:
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
                    book = self.book
                    return _scalar_read(args[0], book.phase, book.padded, book.answers)
            if func is wait_tensor:
                # the CPU and CUDA kernels hand back their input once the collective is done;
                # the fake (Meta) rule makes a new tensor (torch/distributed/
                # _functional_collectives.py, _wait_tensor_meta: empty_like), a storage no
                # real run has (measured: +131,072 B, one logits all-gather, tiny Phi-3, tp=2)
                return args[0]
            if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
                out = grouped_mm_fake(args, kwargs)
            else:
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
            if self.book.on_host:
                hosted: list = []
                tensors_in(out, hosted)
                for t in hosted:
                    st = storage_of(t)
                    if st is not None:
                        self.book.ignore(st)
                return out
            seg = self.segment()
            self.book.drain(seg)
            self.book.see_inputs(args, kwargs, name, mutable, seg)
            self.book.see_outputs(out, args, kwargs, name, seg)
            return out

    return Recorder


def compiled_mode_type() -> type:
    """The recorder for a ``torch.compile``'d model: torch turns a mode that ignores compile
    internals off while it compiles and on while the compiled code runs
    (``TorchDispatchMode.ignore_compile_internals``); any other mode makes Dynamo run the
    model eagerly."""

    import torch
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    state_bytes = torch.get_rng_state().numel()  # the CPU generator's state, a uint8 tensor

    class CompiledRecorder(mode_type()):  # type: ignore[misc]
        supports_higher_order_operators = True

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            if not isinstance(func, torch._ops.HigherOrderOperator):
                return super().__torch_dispatch__(func, types, args, kwargs)
            # a checkpointed region's random op (torch/_prims/rng_prims.py, impl_cpu): the
            # generator's state taken before the op runs, the op itself recorded
            kwargs = kwargs or {}
            if func is run_and_save_rng_state:
                op, *rest = args
                with self:
                    state = torch.empty(state_bytes, dtype=torch.uint8)
                    return state, op(*rest, **kwargs)
            if func is run_with_rng_state:
                _saved, op, *rest = args
                with self:
                    current = torch.empty(state_bytes, dtype=torch.uint8)  # restored after op
                    out = op(*rest, **kwargs)
                    del current
                    return out
            return NotImplemented

    return CompiledRecorder


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """torch's fake-tensor logger off: a failing op is reported once, by `DeriveError`; the
    warnings FSDP1 gives on fake tensors (its resharded check reads ``data_ptr``) and on a
    flat parameter of frozen and trained parameters (LoRA: the estimate counts that
    gradient), and FSDP2's on a compiled layer's output, silenced."""
    import logging
    import warnings

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            warnings.filterwarnings("ignore", message=".*has both parameters with requires_grad")
            # a compiled layer returns a view of Inductor's buffer; transformers' next layer
            # adds to it out of place, so FSDP2's pre-backward hook stays (its warning's case)
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
            yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def eager_paths() -> Iterator[None]:
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


@contextlib.contextmanager
def recorder(book: Book, compiled: bool = False) -> Iterator[Any]:
    """The recorder over ``book``, with the saved-tensor hooks the tracker installs;
    ``compiled``: off while ``torch.compile`` compiles, on while its code runs
    (`calc.derive.inductor`)."""
    import torch

    def pack(t: Any) -> Any:
        st = storage_of(t)
        if st is not None:
            sid = book.known(st)
            if sid is not None:
                book.saved.add(sid)
        return t.detach()

    cls = torch.UntypedStorage
    own = "resize_" in cls.__dict__
    original = cls.resize_
    with (compiled_mode_type() if compiled else mode_type())(book) as mode:

        def resize_(st: Any, size: int) -> Any:  # as the tracker patches it
            out = original(st, size)
            seg = mode.segment()
            book.drain(seg)
            book.resized(st, "UntypedStorage.resize_", seg)
            return out

        cls.resize_ = resize_  # type: ignore[method-assign,assignment]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield mode
        finally:
            if own:
                cls.resize_ = original  # type: ignore[method-assign]
            else:
                del cls.resize_
        book.drain(book.tag_now)
