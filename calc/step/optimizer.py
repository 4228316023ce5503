"""The optimizer phase of a training step, replayed on the `calc.replay.tape.Tape`.

`optimizer_step` plays, in order, every allocation and free that one ``optimizer.step()`` makes
(and, for ``amp-fp16``, the ``GradScaler.step``/``update`` around it; for ``bf16-master``, the
fp32 master-weight wrapper of ``verify.models.optimizers``). Sources, torch 2.13 ``torch/optim``:

* ``adam.py`` (AdamW is ``Adam(decoupled_weight_decay=True)``):
  - ``Adam._init_group``: on the first step, per param in ``parameters()`` order, ``step`` (a
    0-d fp32 *device* tensor only when ``fused``/``capturable``; else ``torch.tensor(0.0)`` on the
    host, which bypasses Python dispatch and never reaches the GPU allocator), then ``exp_avg`` and
    ``exp_avg_sq`` = ``zeros_like(p)`` (param dtype);
  - ``_single_tensor_adam``: per param, coupled decay ``grad = grad.add(param)`` (freed when
    ``grad`` is rebound at the next iteration), ``denom = (exp_avg_sq.sqrt() / bc2).add_(eps)``
    (two temporaries; the sqrt dies after the division; ``denom`` lives until the next
    iteration's ``denom`` exists);
  - ``_multi_tensor_adam``: per (device, dtype) group, coupled decay
    ``device_grads = _foreach_add(grads, params)`` (``del``-ed before the sqrt), then
    ``exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs)``, alive until the next group's sqrt exists;
  - ``_fused_adam``: ``_fused_adam(w)_`` updates in place; no temporaries.
* ``sgd.py``: ``momentum_buffer = grad.detach().clone()`` on the first step (``empty_like(g)``
  for fused), coupled decay ``grad.add(param)`` / ``_foreach_add`` temporaries.
* ``_adafactor.py``: ``row_var``/``col_var`` (``grad.new_zeros``) for >= 2-D params,
  ``variance`` for 1-D; per-step ``row_mean``/``col_mean``/``var_estimate`` (``row_var @
  col_var``) temporaries, 0-d ``norm`` scalars; loop locals outlive their iteration.
* bitsandbytes ``optim/optimizer.py`` ``Optimizer2State.init_state``: uint8 ``state1``/``state2``
  plus fp32 ``absmax1``/``absmax2`` per 256-element block; params with fewer than 4096 elements
  keep fp32 states; on CUDA the two 256-entry fp32 quantisation maps are copied to the device
  once. The update kernels work in place.
* Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Alg. 1), as written in
  ``verify.models.optimizers.Lion``: ``exp_avg`` (param dtype); one update temporary per tensor
  (for-loop) or per (device, dtype) group (foreach).
* ``torch/amp/grad_scaler.py`` for ``amp-fp16``: ``unscale_`` (inverse scale through
  ``double().reciprocal().float()``, ``found_inf``, and a ``copy=True`` per-device copy of each
  from ``_MultiDeviceReplicator``; ``_amp_foreach_non_finite_check_and_unscale_`` is in place) or,
  for fused optimizers, ``_check_inf_per_device`` plus the ``grad_scale`` and summed
  ``found_inf`` handed to the kernel; ``update`` frees the kept ``found_inf`` copy.

Device ``step`` tensors of fused Adam are ``torch.zeros((), device=p.device)``: counted on any
device (the CPU tracker sees them too); the host ``torch.tensor(0.0)`` steps are never counted.

Every tensor created for one parameter is tagged with that parameter's tag (``tape.segment``),
so a caller can scale per-layer tensors; tensors shared by all parameters are tagged ``"base"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import sympy as sp

from calc.config.jobs import (
    DEVICES,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    Training,
    check_choice,
)
from calc.data.bitsandbytes import (
    BNB_BLOCK,
    BNB_MIN_8BIT_SIZE,
    BNB_OPTIMIZERS,
    BNB_PAGED_MIN_NUMEL,
    BNB_QMAP_NUMEL,
)
from calc.replay.tape import Size, Tape, Tensor, round_block

SizeValues = Mapping[sp.Symbol, int]
"""Symbol values at which size thresholds (8-bit Adam's ``min_8bit_size``) are decided: the
model's, from `calc.step.sizes.values_for` (the decisions are part of the compile cache key,
see ``calc.estimate.core._structure_key``). Passed to each call, never kept: the app compiles
on a background thread."""

FP32, FP64, UINT8 = 4, 8, 1
SHARED_TAG = "base"
"""Tag of tensors that belong to no single parameter (GradScaler scalars, quantisation maps)."""

_FUSABLE = ("adam", "adamw", "sgd", "sgd-momentum")


@dataclass(eq=False)
class OptimizerStates:
    """Persistent optimizer tensors on the tape, to pass back for the next step.

    ``per_param`` maps ``id(param.storage)`` to that param's states by name (``exp_avg``,
    ``master``, ...); ``shared`` holds per-device tensors (the 8-bit quantisation maps)."""

    per_param: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    shared: dict[str, Tensor] = field(default_factory=dict)

    def tensors(self) -> list[Tensor]:
        """All state tensors, per param in insertion order, then the shared ones."""
        out = [t for d in self.per_param.values() for t in d.values()]
        return out + list(self.shared.values())


@dataclass(eq=False)
class _Slot:
    """One tensor the optimizer updates: a model param, or its fp32 master (bf16-master)."""

    key: int  # id(model param storage): the key of its states
    numel: Size
    itemsize: int
    tag: object
    shape: tuple | None
    grad: Tensor


class _Alloc:
    """Allocates on the tape under a tag (``tape.segment``, restored after each allocation);
    `state` with ``fresh=False`` makes a pre-existing storage (no event) instead."""

    def __init__(self, tape: Tape) -> None:
        self.tape = tape

    def new(self, tag: object, numel: Size, itemsize: int, name: str, kind: str = "act") -> Tensor:
        saved, self.tape.segment = self.tape.segment, tag
        try:
            return self.tape.new(numel, itemsize, name, kind)
        finally:
            self.tape.segment = saved

    def state(self, fresh: bool, tag: object, numel: Size, itemsize: int, name: str) -> Tensor:
        if fresh:
            return self.new(tag, numel, itemsize, name, "state")
        return self.tape.existing(numel, itemsize, name, "state", tag=tag)

    def scalar(self, tag: object, itemsize: int, name: str) -> None:
        """A 0-d tensor made and dropped at once (``x.norm().item()``)."""
        self.tape.drop(self.new(tag, 1, itemsize, name))

    def drop(self, *ts: Tensor | None) -> None:
        self.tape.drop(*ts)

    def drop_all(self, ts: Sequence[Tensor | None]) -> None:
        self.tape.drop(*ts)


def _groups(slots: Sequence[_Slot]) -> list[list[_Slot]]:
    """``_group_tensors_by_device_and_dtype``: one device, so by dtype (itemsize), params in
    order within each group. Groups come in order of first appearance; torch iterates a C++
    ``std::unordered_map`` (unspecified order; bf16 before fp32 measured on 2.13 CPU), which
    only matters when one optimizer sees params of several dtypes (no supported precision
    does): then the peak can differ by the temporaries alive across a group boundary."""
    groups: dict[int, list[_Slot]] = {}
    for s in slots:
        groups.setdefault(s.itemsize, []).append(s)
    return list(groups.values())


def _is_small(numel: Size, limit: int, size_values: SizeValues | None) -> bool:
    """``numel < limit``; a symbolic size is decided at ``size_values`` (the model's dims,
    `calc.step.sizes.values_for`), else, when sympy cannot decide it, it counts as large."""
    if not isinstance(numel, int) and size_values:
        numel = sp.sympify(numel).subs(list(size_values.items()))
    rel = sp.Lt(numel, limit) if not isinstance(numel, int) else numel < limit
    return bool(rel) if rel in (True, False, sp.true, sp.false) else False


def _prod(xs: Sequence[Size]) -> Size:
    out: Size = 1
    for x in xs:
        out = out * x
    return out


def _factored(shape: tuple) -> tuple[Size, Size, Size]:
    """(lead, rows, cols) of an Adafactor-factored param of shape ``(*lead, R, C)``."""
    return _prod(shape[:-2]), shape[-2], shape[-1]


# ---------------------------------------------------------------------------------- states


def _init_states(
    a: _Alloc,
    slots: Sequence[_Slot],
    st: OptimizerStates,
    optimizer: str,
    impl: str,
    device: str,
    fresh: bool,
    size_values: SizeValues | None,
    paged: bool = False,
) -> None:
    """State creation: ``_init_group`` order for the torch optimizers (all params before any
    update). SGD momentum buffers are made by the update itself on a fresh first step.
    ``paged``: bitsandbytes' paged optimizers, whose ``state1``/``state2`` of a param of at least
    `BNB_PAGED_MIN_NUMEL` elements are not PyTorch's (absent from the tape)."""
    for s in slots:
        d = st.per_param.setdefault(s.key, {})
        n, i, tag = s.numel, s.itemsize, s.tag
        if optimizer in ("adam", "adamw"):
            if impl == "fused":
                d["step"] = a.state(fresh, tag, 1, FP32, "step")
            d["exp_avg"] = a.state(fresh, tag, n, i, "exp_avg")
            d["exp_avg_sq"] = a.state(fresh, tag, n, i, "exp_avg_sq")
        elif optimizer == "sgd-momentum" and not fresh:
            d["momentum_buffer"] = a.state(fresh, tag, n, i, "momentum_buffer")
        elif optimizer == "adafactor":
            if s.shape is None:
                raise ValueError("optimizer='adafactor' needs the shape of every param")
            if len(s.shape) > 1:
                lead, rows, cols = _factored(s.shape)
                d["row_var"] = a.state(fresh, tag, lead * rows, i, "row_var")
                d["col_var"] = a.state(fresh, tag, lead * cols, i, "col_var")
            else:
                d["variance"] = a.state(fresh, tag, n, i, "variance")
        elif optimizer == "lion":
            d["exp_avg"] = a.state(fresh, tag, n, i, "exp_avg")
        elif optimizer in BNB_OPTIMIZERS:
            _bnb_states(a, s, st, d, optimizer, device, fresh, size_values, paged)


def _bnb_states(
    a: _Alloc, s: _Slot, st: OptimizerStates, d: dict[str, Tensor], optimizer: str, device: str,
    fresh: bool, size_values: SizeValues | None, paged: bool,
) -> None:  # fmt: skip
    """bitsandbytes ``Optimizer2State.init_state``: fp32 ``state1``/``state2`` (32-bit, or below
    ``min_8bit_size``), else uint8 ones with fp32 ``absmax1``/``absmax2`` per `BNB_BLOCK` and the
    shared quantisation maps; a paged optimizer's ``state1``/``state2`` of a large param are in
    managed memory (not on the tape)."""
    n, tag = s.numel, s.tag
    outside = paged and not _is_small(n, BNB_PAGED_MIN_NUMEL, size_values)
    if optimizer == "adam32bit" or _is_small(n, BNB_MIN_8BIT_SIZE, size_values):
        if not outside:
            d["state1"] = a.state(fresh, tag, n, FP32, "state1")
            d["state2"] = a.state(fresh, tag, n, FP32, "state2")
        return
    if device == "cuda" and "qmap1" not in st.shared:
        # name2qmap["dynamic"/"udynamic"].to(p.device), once per device
        st.shared["qmap1"] = a.state(fresh, SHARED_TAG, BNB_QMAP_NUMEL, FP32, "qmap1")
        st.shared["qmap2"] = a.state(fresh, SHARED_TAG, BNB_QMAP_NUMEL, FP32, "qmap2")
    blocks = -(-n // BNB_BLOCK) if isinstance(n, int) else sp.ceiling(n / BNB_BLOCK)
    if not outside:
        d["state1"] = a.state(fresh, tag, n, UINT8, "state1")
        d["state2"] = a.state(fresh, tag, n, UINT8, "state2")
    d["absmax1"] = a.state(fresh, tag, blocks, FP32, "absmax1")
    d["absmax2"] = a.state(fresh, tag, blocks, FP32, "absmax2")


# ---------------------------------------------------------------------------------- updates


def _adam(a: _Alloc, slots: Sequence[_Slot], impl: str, coupled_wd: bool) -> None:
    if impl == "fused":
        return  # _fused_adam(w)_: in place
    if impl == "foreach":
        sqrt_prev: list[Tensor] = []
        for group in _groups(slots):
            if coupled_wd:  # device_grads = _foreach_add(device_grads, device_params); del
                a.drop_all([a.new(s.tag, s.numel, s.itemsize, "adam_wd_grad") for s in group])
            sqrt = [a.new(s.tag, s.numel, s.itemsize, "adam_sqrt") for s in group]
            a.drop_all(sqrt_prev)  # exp_avg_sq_sqrt rebound after the new list exists
            sqrt_prev = sqrt
        a.drop_all(sqrt_prev)
        return
    wd_grad: Tensor | None = None
    denom: Tensor | None = None
    for s in slots:
        a.drop(wd_grad)  # grad = grads[i]
        wd_grad = None
        if coupled_wd:
            wd_grad = a.new(s.tag, s.numel, s.itemsize, "adam_wd_grad")
        root = a.new(s.tag, s.numel, s.itemsize, "adam_sqrt")  # exp_avg_sq.sqrt()
        new_denom = a.new(s.tag, s.numel, s.itemsize, "adam_denom")  # ... / bc2_sqrt
        a.drop(root)
        a.drop(denom)
        denom = new_denom
    a.drop(wd_grad, denom)


def _sgd(
    a: _Alloc,
    slots: Sequence[_Slot],
    st: OptimizerStates,
    impl: str,
    wd: bool,
    momentum: bool,
    first: bool,
) -> None:
    def buffer(s: _Slot) -> Tensor:
        t = a.new(s.tag, s.numel, s.grad.itemsize, "momentum_buffer", "state")
        st.per_param.setdefault(s.key, {})["momentum_buffer"] = t
        return t

    if impl == "fused":
        if momentum and first:  # momentum_buffer_list[i] = torch.empty_like(g)
            for s in slots:
                buffer(s)
        return
    if impl == "foreach":
        for group in _groups(slots):
            wd_grads = (
                [a.new(s.tag, s.numel, s.itemsize, "sgd_wd_grad") for s in group] if wd else []
            )
            if momentum and first:
                for s in group:
                    buffer(s)  # device_grads[i].detach().clone()
            a.drop_all(wd_grads)  # device_grads = bufs, or rebound by the next group
        return
    tmp: Tensor | None = None
    for s in slots:
        a.drop(tmp)  # grad = grads[i]
        tmp = a.new(s.tag, s.numel, s.itemsize, "sgd_wd_grad") if wd else None
        if momentum:
            if first:
                buffer(s)  # grad.detach().clone()
            a.drop(tmp)  # grad = buf
            tmp = None
    a.drop(tmp)


def _adafactor(a: _Alloc, slots: Sequence[_Slot], impl: str) -> None:
    def shape_of(s: _Slot) -> tuple:
        assert s.shape is not None
        return s.shape

    if impl == "foreach":
        # _group_tensors_by_device_dtype_and_is_multidim: per dtype, matrix/vector groups in
        # order of first appearance
        groups: list[list[_Slot]] = []
        for dtype_group in _groups(slots):
            by_dim: dict[bool, list[_Slot]] = {}
            for s in dtype_group:
                by_dim.setdefault(len(shape_of(s)) > 1, []).append(s)
            groups.extend(by_dim.values())
        updates_prev: list[Tensor] = []
        for group in groups:
            for s in group:
                a.scalar(s.tag, s.itemsize, "param_norm")  # p.norm(2).item()
            if len(shape_of(group[0])) > 1:
                dims = [_factored(shape_of(s)) for s in group]
                a.drop_all(
                    [
                        a.new(s.tag, ld * r, s.itemsize, "row_mean")
                        for s, (ld, r, _) in zip(group, dims, strict=True)
                    ]
                )
                a.drop_all(
                    [
                        a.new(s.tag, ld * c, s.itemsize, "col_mean")
                        for s, (ld, _, c) in zip(group, dims, strict=True)
                    ]
                )
                ests = [a.new(s.tag, s.numel, s.itemsize, "var_estimate") for s in group]
                a.drop_all(
                    [
                        a.new(s.tag, ld, s.itemsize, "row_var_mean")
                        for s, (ld, _, _) in zip(group, dims, strict=True)
                    ]
                )
            else:
                a.drop_all([a.new(s.tag, s.numel, s.itemsize, "grad_squared") for s in group])
                ests = [a.new(s.tag, s.numel, s.itemsize, "var_estimate") for s in group]
            a.drop_all(updates_prev)  # updates = var_estimates
            updates_prev = ests
            for s in group:
                a.scalar(s.tag, s.itemsize, "update_norm")  # update.norm(2).item()
        a.drop_all(updates_prev)
        return
    # _single_tensor_adafactor: loop locals live until rebound (or the function returns)
    row_mean: Tensor | None = None
    col_mean: Tensor | None = None
    update: Tensor | None = None
    grad_squared: Tensor | None = None
    for s in slots:
        a.scalar(s.tag, s.itemsize, "param_norm")
        if len(shape_of(s)) > 1:
            lead, rows, cols = _factored(shape_of(s))
            t = a.new(s.tag, lead * rows, s.itemsize, "row_mean")
            a.drop(row_mean)
            row_mean = t
            t = a.new(s.tag, lead * cols, s.itemsize, "col_mean")
            a.drop(col_mean)
            col_mean = t
            est = a.new(s.tag, s.numel, s.itemsize, "var_estimate")  # row_var @ col_var
            a.drop(a.new(s.tag, lead, s.itemsize, "row_var_mean"))  # row_var.mean(-2).clamp_
        else:
            t = a.new(s.tag, s.numel, s.itemsize, "grad_squared")
            a.drop(grad_squared)
            grad_squared = t
            est = a.new(s.tag, s.numel, s.itemsize, "var_estimate")  # variance.clone()
        a.drop(update)  # update = var_estimate.clamp_(...).rsqrt_(): old estimate released
        update = est
        a.scalar(s.tag, s.itemsize, "update_norm")
    a.drop(row_mean, col_mean, update, grad_squared)


def _lion(a: _Alloc, slots: Sequence[_Slot], impl: str) -> None:
    if impl == "foreach":
        for group in _groups(slots):  # updates = _foreach_mul(exp_avgs, beta1); ...; del
            a.drop_all([a.new(s.tag, s.numel, s.itemsize, "lion_update") for s in group])
        return
    for s in slots:  # update = exp_avg.mul(beta1); ...; del update
        a.drop(a.new(s.tag, s.numel, s.itemsize, "lion_update"))


# ---------------------------------------------------------------------------------- the step


def _update(
    a: _Alloc,
    slots: Sequence[_Slot],
    st: OptimizerStates,
    optimizer: str,
    impl: str,
    wd: bool,
    first_step: bool,
) -> None:
    """The update's temporaries, per optimizer (``wd``: a non-zero weight decay)."""
    if optimizer in ("adam", "adamw"):
        _adam(a, slots, impl, coupled_wd=wd and optimizer != "adamw")  # adamw: decoupled
    elif optimizer in ("sgd", "sgd-momentum"):
        _sgd(a, slots, st, impl, wd, optimizer == "sgd-momentum", first_step)
    elif optimizer == "adafactor":
        _adafactor(a, slots, impl)
    elif optimizer == "lion":
        _lion(a, slots, impl)
    # adam8bit, adam32bit: bitsandbytes' update kernels write in place


def optimizer_step(
    tape: Tape,
    params: Sequence[Tensor],
    *,
    optimizer: str,
    impl: str,
    precision: str,
    first_step: bool,
    weight_decay: float,
    device: str,
    shapes: Sequence[tuple] | None = None,
    states: OptimizerStates | None = None,
    size_values: SizeValues | None = None,
    paged: bool = False,
) -> OptimizerStates:
    """Replay one optimizer step on ``tape`` and return the persistent states.

    ``params`` are the model's parameter leaves in ``model.parameters()`` order; each one's
    gradient is ``tape.grads[id(p.storage)]``, its dtype is its ``itemsize`` (4 fp32, 2 bf16).
    ``shapes`` (per param) is needed by Adafactor only; ``size_values`` (`SizeValues`) decide
    8-bit Adam's ``min_8bit_size`` for symbolic sizes. ``states`` are those returned by the
    previous step (or by `existing_states`); with ``first_step=False`` and no ``states``,
    `existing_states` makes them first, which adds to ``tape.live`` before the first event. The
    events carry the tape's current phase (the caller names it, e.g. ``step1/optimizer``).

    Precision: ``bf16-master`` wraps the optimizer as ``verify.models.optimizers.MasterWeights`` does:
    on the first step fp32 masters ``p.detach().float()`` (kind ``state``); every step the fp32
    grads ``p.grad.float()`` of all params, the inner fp32 step over the masters,
    ``p.copy_(master)`` (in place), then the fp32 grads are dropped. ``amp-fp16`` adds the
    GradScaler's ``step`` and ``update`` scalars.

    Example (hand-derived in ``tests/calc/step/test_optimizer.py``): AdamW foreach fp32, params of
    1000 and 10 elements, first step: states 2*(4096+512) B, then the sqrt temporary 4096+512 B.
    """
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("optimizer_impl", impl, OPTIMIZER_IMPLS)
    check_choice("precision", precision, PRECISIONS)
    check_choice("device", device, DEVICES)
    if impl == "fused" and optimizer not in _FUSABLE:
        raise ValueError(f"optimizer_impl='fused' is not available for optimizer={optimizer!r}")
    if shapes is not None and len(shapes) != len(params):
        raise ValueError(f"shapes has {len(shapes)} entries for {len(params)} params")
    if not first_step and states is None:
        states = existing_states(
            tape,
            params,
            optimizer=optimizer,
            impl=impl,
            precision=precision,
            device=device,
            shapes=shapes,
            size_values=size_values,
            paged=paged,
        )
    st = states if states is not None else OptimizerStates()
    a = _Alloc(tape)
    saved_phase = tape.phase
    slots = _slots(tape, params, shapes)
    master_grads: list[Tensor] = []
    if precision == "bf16-master":
        if first_step:
            for s in slots:  # masters = [p.detach().float()]
                st.per_param.setdefault(s.key, {})["master"] = a.new(
                    s.tag, s.numel, FP32, "master", "state"
                )
        for s in slots:
            s.grad = a.new(s.tag, s.numel, FP32, "master_grad", "grad")  # p.grad.float()
            s.itemsize = FP32
            master_grads.append(s.grad)
    scaler_fused = precision == "amp-fp16" and impl == "fused"
    found_inf = _scaler_before(a, fused=scaler_fused) if precision == "amp-fp16" else []
    if first_step:  # inside optimizer.step(), after GradScaler's unscale_ / inf check
        _init_states(a, slots, st, optimizer, impl, device, True, size_values, paged)
    _update(a, slots, st, optimizer, impl, weight_decay != 0, first_step)
    for t in found_inf:  # grad_scale/found_inf attributes deleted, then update() resets state
        a.drop(t)
    a.drop_all(master_grads)  # master.grad = None
    tape.phase = saved_phase
    return st


@dataclass
class OptimizerTail:
    """The end of every replayed training step, written once for the plain and the pipeline
    replays: ``optimizer.step()`` (`optimizer_step`, the states carried from step to step),
    then ``zero_grad(set_to_none=True)`` when ``job.zero_grad == "after_step"``. With
    ``offloaded`` (DeepSpeed-style CPU offload) the states and the step live on the host:
    the GPU only drops the gradients, which went to the host during the backward."""

    job: Training
    device: str
    params: Sequence[Tensor]
    """The parameter leaves this rank's optimizer steps."""
    shapes: Sequence[tuple] | None
    size_values: SizeValues | None
    offloaded: bool = False
    states: OptimizerStates | None = None
    """The states after the last step (``None`` before the first)."""
    in_backward_states: dict = field(default_factory=dict)
    """``optimizer_in_backward``: each parameter's own optimizer states (storage id ->
    `OptimizerStates`)."""

    def step(self, tape: Tape, *, first_step: bool) -> None:
        """Replay the step on ``tape``, in the phase the caller set."""
        if self.offloaded:
            tape.zero_grad()
            return
        job = self.job
        if job.optimizer is None or job.optimizer_in_backward:  # nothing (left) to step
            if job.zero_grad == "after_step":
                tape.zero_grad()
            return
        self.states = optimizer_step(
            tape, self.params, optimizer=job.optimizer, impl=job.optimizer_impl,
            precision=job.precision, first_step=first_step, weight_decay=job.weight_decay,
            device=self.device, states=self.states, shapes=self.shapes,
            size_values=self.size_values, paged=job.paged_optimizer,
        )  # fmt: skip
        if job.zero_grad == "after_step":
            tape.zero_grad()

    def in_backward(self, tape: Tape, leaf: Tensor) -> None:
        """torchtune's ``optimizer_in_bwd`` (``register_optim_in_bwd_hooks``): the hook after
        ``leaf``'s gradient is accumulated steps the leaf's own optimizer (its states made at
        its first step) and ``zero_grad``s it: the gradient is dropped at once."""
        idx = next((i for i, p in enumerate(self.params) if p.storage is leaf.storage), None)
        if idx is None:
            return
        job, key = self.job, id(leaf.storage)
        prev = self.in_backward_states.get(key)
        assert job.optimizer is not None  # Training refuses optimizer_in_backward without one
        self.in_backward_states[key] = optimizer_step(
            tape, [self.params[idx]], optimizer=job.optimizer, impl=job.optimizer_impl,
            precision=job.precision, first_step=prev is None, weight_decay=job.weight_decay,
            device=self.device, states=prev, size_values=self.size_values,
            shapes=None if self.shapes is None else [self.shapes[idx]],
            paged=job.paged_optimizer,
        )  # fmt: skip
        tape.drop(tape.grads.pop(key))


def _slots(tape: Tape, params: Sequence[Tensor], shapes: Sequence[tuple] | None) -> list[_Slot]:
    slots = []
    for k, p in enumerate(params):
        grad = tape.grads.get(id(p.storage))
        if grad is None:
            continue  # p.grad is None: the optimizer skips the param
        shape = tuple(shapes[k]) if shapes is not None else None
        slots.append(_Slot(id(p.storage), p.numel, p.itemsize, p.storage.tag, shape, grad))
    return slots


def existing_states(
    tape: Tape,
    params: Sequence[Tensor],
    *,
    optimizer: str,
    impl: str,
    precision: str,
    device: str,
    shapes: Sequence[tuple] | None = None,
    size_values: SizeValues | None = None,
    paged: bool = False,
) -> OptimizerStates:
    """The states a step after the first finds (made by an earlier step), as storages alive
    before the replay (``Tape.existing``: no event), tagged like `optimizer_step` tags them."""
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("precision", precision, PRECISIONS)
    st = OptimizerStates()
    a = _Alloc(tape)
    slots = _slots(tape, params, shapes)
    if precision == "bf16-master":
        for s in slots:
            st.per_param.setdefault(s.key, {})["master"] = a.state(
                False, s.tag, s.numel, FP32, "master"
            )
            s.itemsize = FP32
    _init_states(a, slots, st, optimizer, impl, device, False, size_values, paged)
    return st


def _scaler_before(a: _Alloc, *, fused: bool) -> list[Tensor]:
    """GradScaler.step up to ``optimizer.step()``; returns what lives until after it, in the order
    it is freed (``del optimizer.grad_scale``, ``del optimizer.found_inf``, ``update()``).

    ``_unscale_grads_`` hands the kernel ``_MultiDeviceReplicator.get(device)`` of ``found_inf``
    and of the inverse scale, i.e. ``.to(device, copy=True)``: two more 0-d copies, the first of
    which (``found_inf_per_device``) outlives the originals until ``update()``."""
    tag = SHARED_TAG
    if fused:
        # _check_inf_per_device: dummy_inv_scale and found_inf = full((), ...), their copies
        dummy = a.new(tag, 1, FP32, "dummy_inv_scale")
        found_inf = a.new(tag, 1, FP32, "found_inf")
        found_copy = a.new(tag, 1, FP32, "found_inf_per_device")
        dummy_copy = a.new(tag, 1, FP32, "dummy_inv_scale_copy")
        a.drop(dummy_copy, dummy, found_inf)  # replicator, then the locals
        found_sum = a.new(tag, 1, FP32, "found_inf_sum")  # sum([found_inf]) = 0 + found_inf
        grad_scale = a.new(tag, 1, FP32, "grad_scale")  # scale * 1
        return [grad_scale, found_sum, found_copy]
    # unscale_: inv_scale = scale.double().reciprocal().float(); found_inf = full((), 0.)
    double = a.new(tag, 1, FP64, "scale_double")
    recip = a.new(tag, 1, FP64, "inv_scale_double")
    a.drop(double)
    inv = a.new(tag, 1, FP32, "inv_scale")
    a.drop(recip)
    found_inf = a.new(tag, 1, FP32, "found_inf")
    found_copy = a.new(tag, 1, FP32, "found_inf_per_device")
    inv_copy = a.new(tag, 1, FP32, "inv_scale_copy")
    a.drop(inv_copy, inv, found_inf)
    return [found_copy]


# ---------------------------------------------------------------------------------- closed forms


def state_bytes_per_param(
    numel: Size,
    itemsize: int,
    *,
    optimizer: str,
    impl: str,
    precision: str,
    shape: tuple | None = None,
    size_values: SizeValues | None = None,
) -> Size:
    """Persistent optimizer bytes of one param (each tensor rounded to 512 B), excluding the
    per-device tensors (8-bit quantisation maps). ``itemsize`` is the model param's.

    Per tensor, as `optimizer_step` allocates them: Adam(W) ``2 * r(n*s)`` (+512 for a fused
    device ``step``); SGD-momentum ``r(n*s)``; Lion ``r(n*s)``; Adafactor ``r(lead*R*s) +
    r(lead*C*s)`` (or ``r(n*s)`` for 1-D); 8-bit Adam ``2*r(n) + 2*r(4*ceil(n/256))`` (or
    ``2*r(4n)`` below 4096 elements); bf16-master adds ``r(4n)`` and states in fp32.
    """
    r = round_block
    s = FP32 if precision == "bf16-master" else itemsize
    extra: Size = r(numel * FP32) if precision == "bf16-master" else 0
    if optimizer in ("adam", "adamw"):
        core: Size = 2 * r(numel * s) + (r(FP32) if impl == "fused" else 0)
    elif optimizer in ("sgd-momentum", "lion"):
        core = r(numel * s)
    elif optimizer == "sgd":
        core = 0
    elif optimizer == "adafactor":
        if shape is None:
            raise ValueError("optimizer='adafactor' needs the param shape")
        if len(shape) > 1:
            lead, rows, cols = _factored(tuple(shape))
            core = r(lead * rows * s) + r(lead * cols * s)
        else:
            core = r(numel * s)
    elif optimizer == "adam8bit":
        if _is_small(numel, BNB_MIN_8BIT_SIZE, size_values):
            core = 2 * r(numel * FP32)
        else:
            blocks = (
                -(-numel // BNB_BLOCK) if isinstance(numel, int) else sp.ceiling(numel / BNB_BLOCK)
            )
            core = 2 * r(numel * UINT8) + 2 * r(blocks * FP32)
    elif optimizer == "adam32bit":  # fp32 states whatever the param's dtype
        core = 2 * r(numel * FP32)
    else:
        check_choice("optimizer", optimizer, OPTIMIZERS)
        raise AssertionError(optimizer)
    return core + extra


def paged_state_bytes(numels: Sequence[int], optimizer: str) -> int:
    """Bytes of a paged bitsandbytes optimizer's states in CUDA managed memory, outside
    PyTorch's allocator: ``state1`` and ``state2`` of every trained param of at least
    `BNB_PAGED_MIN_NUMEL` elements (``get_state_buffer``), uint8 for ``adam8bit`` (such a param
    is above ``min_8bit_size``) and fp32 for ``adam32bit``; unrounded (``F.get_paged`` asks
    ``cudaMallocManaged`` for the exact bytes)."""
    itemsize = UINT8 if optimizer == "adam8bit" else FP32
    return sum(2 * n * itemsize for n in numels if n >= BNB_PAGED_MIN_NUMEL)
