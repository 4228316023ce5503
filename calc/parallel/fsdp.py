"""Parameter, gradient and optimizer-state sharding on one rank: FSDP2 (ZeRO-3) and ZeRO-1/2.

**FSDP2** (``fully_shard`` on every decoder layer, then on the root; PyTorch 2.13,
``torch/distributed/fsdp/_fully_shard/``), replayed event by event on the tape, N ranks,
without or with a ``MixedPrecisionPolicy`` (last item):

* at rest each parameter is its dim-0 shard, padded to a multiple of N
  (``_get_dim0_padded_size``): ``ceil(dim0 / N) * rest`` elements (``new_zeros`` at init);
* ``unshard`` of a group allocates the all-gather output, ``N * sum(padded shard)`` elements
  (``foreach_all_gather``); the copy-out then ``resize_``s each parameter's unsharded storage
  back (``alloc_all_gather_outputs``). In the forward the all-gather output is kept until the
  next group's all-gather is issued (``comm_ctx.all_gather_state``, freed in the next
  ``wait_for_unshard``; the last one at the root's post-forward); in the backward it is freed
  right after the copy-out;
* ``reshard`` (post-forward when ``reshard_after_forward``, post-backward always) ``resize_(0)``s
  the unsharded storages;
* backward: the root unshards at the start and prefetches the last layer; each layer's
  pre-backward copies out its parameters and prefetches the previous layer's all-gather
  (``_backward_prefetch``); its post-backward reshards, frees the previous group's
  reduce-scatter input (at most one in flight, ``reduce_scatter_max_input_buffers``), allocates
  its own (``sum(padded unsharded)`` elements), frees the unsharded gradients, and allocates
  the reduce-scatter output (``sum(padded shard)``), of which the sharded gradients are views.
  The root's post-backward runs in the final callback, which then frees the last input.
* ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32|bf16)`` on an fp32 model: the
  shards stay fp32 (``orig_dtype``, ``_fsdp_param.py`` ``init_dtype_attrs`` l. 586-599) and the
  optimizer steps them (fp32 states); each all-gather first casts the group's shards into one
  flat bf16 buffer (``_fsdp_collectives.py`` ``_get_param_all_gather_inputs``, ``torch.empty``
  l. 419 and ``_foreach_copy_``), freed after the copy-in (``del param_all_gather_inputs``
  l. 361), then gathers bf16; forward and backward run in bf16 (bf16 unsharded gradients); the
  reduce-scatter input and output are in ``reduce_dtype`` (``foreach_reduce`` l. 597, 612),
  and a bf16 output is cast to an fp32 copy (``_to_dtype_if_needed`` l. 696) of which the
  sharded gradients are views. ``cast_forward_inputs`` (``_fsdp_state.py`` l. 312) casts the
  reference model's fp32 RoPE tables at each layer's entry (the replay casts them in the
  attention, as ``rope[0].to(q.dtype)`` does: same bytes, measured exact).
* HSDP (``replicated``: ``fully_shard`` over a 2-D mesh, sharded over its second dimension):
  as above over the shard group's N ranks; ``foreach_reduce`` then all-reduces each group's
  reduce-scatter output in place across the replicas and keeps it
  (``FSDPParamGroup._all_reduce_state``, PR #140044) until the final callback's
  ``finalize_backward``: a bf16 ``reduce_dtype`` output stays beside its fp32 cast, and a
  later micro-batch's output beside the accumulated gradients, to the end of the backward.
* torchtitan's units (``own_units``; torchtitan 0.2.2 ``apply_fsdp``): ``fully_shard`` on the
  embedding, on each block, on ``[norm, output]`` with ``reshard_after_forward=False``, then on
  a root that holds no parameter. The embedding is gathered for its forward and resharded
  after it, gathered again on the prefetch of the first block's pre-backward, and reduced in
  the final callback (its input, the token ids, needs no gradient); the head unit stays
  unsharded from its forward through its backward, and its pre-backward prefetches the last
  block.

**ZeRO-1/2 with sharded states** (Rajbhandari et al. 2020, §5.1-5.2; analytic, no PyTorch engine
runs it): the optimizer steps each parameter's dim-0 shard (states ``1/N``); with ZeRO-2 each
gradient is reduce-scattered as soon as it is ready, its shard kept and the full gradient freed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import sympy as sp

from calc.replay.tape import Size, Storage, Tape, Tensor, round_block

SHARD_ITEMSIZE = 4
"""Bytes per element of the sharded parameters under a mixed-precision policy (an fp32 model)."""


def shard_numel(shape: Sequence[Size], n: int) -> Size:
    """Elements of one rank's dim-0 shard of ``shape`` over ``n`` ranks, padded:
    ``ceil(dim0 / n) * prod(rest)`` (FSDP2 ``_get_dim0_padded_size`` / n)."""
    rest: Size = 1
    for d in shape[1:]:
        rest = rest * d
    dim0 = shape[0]
    rows = -(-dim0 // n) if isinstance(dim0, int) else sp.ceiling(dim0 / n)
    return rows * rest


@dataclass(eq=False)
class Group:
    """One ``fully_shard`` unit: its parameter leaves and their shards."""

    tag: object
    leaves: list[Tensor]
    shard_numels: list[Size]
    itemsize: int
    ag_out: Tensor | None = None
    reduce_out: Tensor | None = None

    @property
    def shard_total(self) -> Size:
        return sp.Add(*self.shard_numels) if self.shard_numels else 0

    @property
    def shard_bytes(self) -> Size:
        """Bytes of the group's all-gather inputs on one rank: with several dtypes (an
        ``NF4Tensor``'s uint8, int8 and 16-bit inner tensors beside the adapters) FSDP2
        gathers them as uint8 (``foreach_all_gather``: ``t.view(torch.uint8)``), the same
        bytes as one dtype's."""
        terms = [n * p.itemsize for n, p in zip(self.shard_numels, self.leaves, strict=True)]
        return sp.Add(*terms) if terms else 0


@dataclass(eq=False)
class Fsdp:
    """FSDP2's hooks on the tape (module docstring)."""

    n: int
    reshard_after_forward: bool
    offload: str = "none"
    """``optimizer+params``: shards live on the CPU; any offload: gradient shards go to the
    CPU as soon as they are reduced."""
    groups: dict = field(default_factory=dict)  # tag -> Group ("root" for the root)
    order: list = field(default_factory=list)  # forward order of layer tags
    kept_ag: Tensor | None = None  # all_gather_state: the forward's last all-gather output
    rs_inputs: list = field(default_factory=list)  # reduce-scatter inputs in flight
    unsharded: set = field(default_factory=set)  # tags whose parameters are unsharded
    pads: dict = field(default_factory=dict)  # leaf storage id -> padding storage
    sharded_grads: dict = field(default_factory=dict)  # leaf storage id -> view of its shard
    reduced: set = field(default_factory=set)  # tags whose post-backward ran in this backward
    mixed: bool = False
    """``MixedPrecisionPolicy(param_dtype=bf16)``: the leaves are the bf16 unsharded parameters,
    the shards (``shards``) stay fp32 (`SHARD_ITEMSIZE`), the optimizer steps them."""
    reduce_itemsize: int = 0
    """``MixedPrecisionPolicy(reduce_dtype=...)``: the reduce-scatter's bytes per element (0:
    the gradients')."""
    shards: dict = field(default_factory=dict)  # leaf storage id -> fp32 shard (mixed)
    replicated: bool = False
    """HSDP (``dp_replicate > 1``): each group's reduce-scatter output, in ``reduce_dtype``, is
    all-reduced in place across the replicas and held (``FSDPParamGroup._all_reduce_state``)
    until the group's ``finalize_backward`` in the final callback."""
    ar_held: dict = field(default_factory=dict)  # tag -> all-reduce buffer held (HSDP)
    own_units: bool = False
    """torchtitan's layout (``apply_fsdp``): the embedding (tag ``"embed"``) and the final norm
    with the head (tag ``"head"``, ``fully_shard([norm, output])``, never resharded after
    forward) are units of their own; the root holds no parameter (module docstring)."""

    def _group_tag(self, tag: object) -> object:
        """The unit a parameter tagged ``tag`` belongs to."""
        if isinstance(tag, int) or (self.own_units and tag in ("embed", "head")):
            return tag
        return "root"

    def _unit(self, tag: object) -> bool:
        """Whether ``tag`` is a unit other than the root (a layer, or an own unit)."""
        return tag != "root" and tag in self.groups

    # ------------------------------------------------------------------ setup

    def install(
        self, tape: Tape, params: Sequence[Tensor], shapes: Sequence[tuple],
        unpadded: frozenset[int] = frozenset(),
    ) -> None:  # fmt: skip
        """Shard every parameter: its unsharded storage is freed (``resize_(0)``) and a padded
        shard (kind ``weight``) exists instead; group by layer (``int`` tags) and root.
        ``unpadded``: storage ids of all-gather inputs that split evenly over the ranks with
        no padding (a torchao ``NF4Tensor``'s inner tensors, `calc.compress.nf4_torchao`)."""
        for p, shape in zip(params, shapes, strict=True):
            tag = self._group_tag(p.storage.tag)
            g = self.groups.setdefault(tag, Group(tag, [], [], p.itemsize))
            numel = shard_numel(shape, self.n)
            g.leaves.append(p)
            g.shard_numels.append(numel)
            # The unsharded storage is the padded all-gather output of this parameter
            # (``init_all_gather_outputs``: N x padded shard); the leaf keeps its own size (its
            # gradient has it), and the padding is a storage of the difference that comes and
            # goes with it (both sizes are 512-byte multiples, so the sum is exact).
            pad: Size = 0
            if id(p.storage) not in unpadded:
                pad = round_block(self.n * numel * p.itemsize) - p.storage.size
            if pad != 0:
                st = Storage(pad, f"pad:{p.name}", "weight", p.storage.tag)
                st.refs = 1
                self.pads[id(p.storage)] = st
            if self.offload != "optimizer+params":
                item = SHARD_ITEMSIZE if self.mixed else p.itemsize
                sh = tape.existing(numel, item, f"shard:{p.name}", "weight", tag=p.storage.tag)
                if self.mixed:
                    self.shards[id(p.storage)] = sh
            tape.hide(p.storage, p.name)
        tape.segment_hook = self.on_segment

    def optimizer_params(self, tape: Tape, params: Sequence[Tensor]) -> list[Tensor]:
        """The sharded parameters the optimizer steps (views of each leaf, shard-sized; the
        fp32 shards themselves under a mixed-precision policy)."""
        if self.mixed:
            return [self.shards[id(p.storage)] for p in params]
        out = []
        for p in params:
            g = self.groups[self._group_tag(p.storage.tag)]
            out.append(tape.alias(p, numel=g.shard_numels[g.leaves.index(p)]))
        return out

    # ------------------------------------------------------------------ collectives

    def _all_gather(self, tape: Tape, g: Group) -> None:
        # Mixed precision: ``_get_param_all_gather_inputs`` casts the fp32 shards into one
        # flat bf16 buffer (``torch.empty`` + ``_foreach_copy_``) before the all-gather output
        # is allocated; it dies after the copy-in (``del param_all_gather_inputs``,
        # _fsdp_collectives.py ``foreach_all_gather``).
        cast = None
        if self.mixed:
            cast = tape.new(g.shard_total, g.itemsize, f"fsdp.all_gather_in[{g.tag}]", tag=g.tag)
        g.ag_out = tape.new(self.n * g.shard_bytes, 1, f"fsdp.all_gather[{g.tag}]", tag=g.tag)
        tape.drop(cast)

    def _copy_out(self, tape: Tape, g: Group, keep: bool) -> None:
        if g.tag in self.unsharded:
            return
        for p in g.leaves:
            tape.unhide(p.storage, p.name)
            if id(p.storage) in self.pads:
                tape.unhide(self.pads[id(p.storage)], f"pad:{p.name}")
        # wait_for_unshard frees the previous forward all-gather result, but its local
        # ``prev_all_gather_state`` (the walrus in ``_fsdp_param_group.py``) keeps it alive
        # until the function returns, i.e. through this group's copy-out.
        if keep and self.kept_ag is not None:
            tape.drop(self.kept_ag)
            self.kept_ag = None
        self.unsharded.add(g.tag)
        if keep:
            self.kept_ag = g.ag_out
        else:
            tape.drop(g.ag_out)
        g.ag_out = None

    def _reshard(self, tape: Tape, g: Group) -> None:
        if g.tag not in self.unsharded:
            return
        for p in g.leaves:
            tape.hide(p.storage, p.name)
            if id(p.storage) in self.pads:
                tape.hide(self.pads[id(p.storage)], f"pad:{p.name}")
        self.unsharded.discard(g.tag)

    def _unshard(self, tape: Tape, g: Group | None, forward: bool) -> None:
        if g is None or g.tag in self.unsharded:
            return
        if g.ag_out is None:
            self._all_gather(tape, g)
        self._copy_out(tape, g, keep=forward)

    def _prefetch(self, tape: Tape, tag: object) -> None:
        g = self.groups[tag]
        if tag not in self.unsharded and g.ag_out is None:
            self._all_gather(tape, g)

    def _post_backward(self, tape: Tape, g: Group | None) -> None:
        if g is None:  # torchtitan's root: no parameter of its own
            return
        self.reduced.add(g.tag)
        grads = [tape.grads.pop(id(p.storage), None) for p in g.leaves]
        self._reshard(tape, g)
        while self.rs_inputs:
            tape.drop(self.rs_inputs.pop(0))
        have = [(p, gr) for p, gr in zip(g.leaves, grads, strict=True) if gr is not None]
        if not have:
            return
        # Only the parameters with a gradient are reduce-scattered (``fsdp_params_with_grad``):
        # all of them in full training, the adapters alone under LoRA (frozen base).
        total = sp.Add(*[n for n, gr in zip(g.shard_numels, grads, strict=True) if gr is not None])
        red = self.reduce_itemsize or have[0][0].itemsize  # reduce_dtype or the grads'
        rs_in = tape.new(self.n * total, red, f"fsdp.reduce_scatter_in[{g.tag}]",
                         tag=g.tag)  # fmt: skip
        tape.drop(*[gr for _, gr in have])
        out = tape.new(total, red, f"fsdp.grad_shards[{g.tag}]", "grad", g.tag)
        if self.replicated:  # all_reduce(reduce_output) in place, its buffer held
            self.ar_held[g.tag] = tape.alias(out)
        if self.mixed and red != SHARD_ITEMSIZE:  # _to_dtype_if_needed(reduce_output, orig)
            cast = tape.new(total, SHARD_ITEMSIZE, f"fsdp.grad_shards[{g.tag}]", "grad", g.tag)
            tape.drop(out)
            out = cast
        for p, _ in have:
            key = id(self.shards[id(p.storage)].storage) if self.mixed else id(p.storage)
            if self.offload == "none" and key not in self.sharded_grads:
                self.sharded_grads[key] = tape.alias(out)  # else accumulated, or sent to host
        tape.drop(out)  # the sharded gradients are views of it (accumulating: a temporary)
        self.rs_inputs.append(rs_in)

    def before_optimizer(self, tape: Tape) -> None:
        """``.grad`` of the sharded parameters is what the optimizer and ``zero_grad`` see."""
        tape.grads.update(self.sharded_grads)
        self.sharded_grads = {}

    # ------------------------------------------------------------------ hooks

    def on_segment(self, tape: Tape, old: object, new: object) -> None:
        """Layer boundaries: pre/post-forward in the forward, pre/post-backward in the backward
        (the engine runs a layer's nodes together; its post-backward node runs right after)."""
        if tape.phase.endswith("/forward") and tape.grad_enabled:
            if self._unit(old) and old != "head":  # the head unit stays unsharded
                if self.reshard_after_forward:
                    self._reshard(tape, self.groups[old])
            if new == "embed" and "root" not in self.unsharded:
                self._unshard(tape, self.groups.get("root"), forward=True)
            if self._unit(new):
                if new not in self.order:
                    self.order.append(new)
                self._unshard(tape, self.groups[new], forward=True)
            return
        if not tape.phase.endswith("/backward") or tape.grad_enabled:
            return  # the optimizer step tags its allocations with layers: no hooks there
        if self._unit(old):
            self._post_backward(tape, self.groups[old])
        if self._unit(new):
            self._unshard(tape, self.groups[new], forward=False)
            i = self.order.index(new)
            if i > 0:
                self._prefetch(tape, self.order[i - 1])

    def end_forward(self, tape: Tape) -> None:
        """The root's post-forward: reshard it, then free the last all-gather output."""
        if self.reshard_after_forward and "root" in self.groups:
            self._reshard(tape, self.groups["root"])
        if self.kept_ag is not None:
            tape.drop(self.kept_ag)
            self.kept_ag = None

    def start_backward(self, tape: Tape) -> None:
        """The root's pre-backward: unshard it, prefetch the last layer's all-gather."""
        self.reduced = set()
        self._unshard(tape, self.groups.get("root"), forward=False)
        layers = [tag for tag in self.order if isinstance(tag, int)]
        if layers:  # under own units, the head's pre-backward prefetches the last layer
            self._prefetch(tape, layers[-1])

    def _finalize(self, tape: Tape, tag: object) -> None:
        """``finalize_backward`` of a group: HSDP's held all-reduce buffer is released."""
        held = self.ar_held.pop(tag, None)
        if held is not None:
            tape.drop(held)

    def end_backward(self, tape: Tape) -> None:
        """The final callback (``_root_post_backward_final_callback``): in ``named_modules()``
        pre-order (root, then the layers in order), the post-backward of every group whose
        own did not run: the root, and a layer whose forward inputs needed no gradient (the
        first layer under LoRA: a frozen embedding's output), each followed by the group's
        ``finalize_backward`` (states in pre-order, ``_fsdp_state.py``
        ``_root_post_backward_final_callback``); then the last reduce-scatter input is freed."""
        self._post_backward(tape, self.groups.get("root"))
        self._finalize(tape, "root")
        for tag in self.order:
            if tag not in self.reduced:
                self._post_backward(tape, self.groups[tag])
            self._finalize(tape, tag)
        while self.rs_inputs:
            tape.drop(self.rs_inputs.pop(0))
