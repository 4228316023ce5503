"""Pipeline parallelism: one stage's training step, replayed as ``torch.distributed.pipelining``
runs it (``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``, torch 2.13).

Stage ``r`` of ``pp`` holds the layers `calc.config.parallelism.layers_per_stage` gives it, plus the
embedding (first stage) or the final norm, the head and the loss (last stage). A step splits
the batch into ``m = pp_microbatches`` micro-batches of ``micro_batch / m`` sequences and runs
the schedule's actions in order (`schedule_actions`):

* GPipe (Huang et al. 2019): all ``m`` forwards, then all ``m`` backwards: a stage holds the
  activations of ``m`` micro-batches at the turn;
* 1F1B (Narayanan et al. 2021, PipeDream-Flush, §2.2): stage ``r`` runs ``min(m, pp - r)``
  forwards, then alternates backward/forward: at most ``pp - r`` micro-batches in flight, so
  the first stage holds the most (``Schedule1F1B._step_microbatches``: ``warmup_chunks``).

What the stage holds besides the single-GPU tensors (``torch/distributed/pipelining/stage.py``
and ``schedules.py``), each a tape event here:

* receive buffers, allocated at the first step for all ``m`` micro-batches and kept for the
  run: activations ``[b/m, s, h]`` on every stage but the first (leaves that require grad:
  the stage input's gradient accumulates into their ``.grad`` and is handed to the send),
  gradients ``[b/m, s, h]`` on every stage but the last (the backward's seed);
* ``fwd_cache``: each micro-batch's stage output, kept from its forward to its backward (the
  last layer's output is saved by nothing else);
* the tensors a stage sends stay referenced by the schedule's send lists (a Work keeps its
  tensor): GPipe keeps every forward send's work (``fwd_sends_to_wait``: the stage outputs,
  past their backwards) and every backward send's (``bwd_sends_to_wait``: the input
  gradients) to the end of the step;
  1F1B's ``bwd_sends`` (then ``send_work``) holds one until the next backward replaces it;
* 1F1B's warm-up: the Work of the last forward send it fires (micro-batch ``w - 2``) keeps
  that stage output alive past its backward, until the 1B1F loop ends (`_warmup_send`);
* last stage: ``output_chunks`` keeps every micro-batch's logits ``[b/m, s, V]`` until the
  next step starts (``clear_runtime_states``), and ``step()`` returns them concatenated
  (``merge_chunks``: one ``[b, s, V]`` tensor, dropped by the caller); the losses are kept to
  the end of the step; the backward seed is ``ones_like(loss)``.

Interleaved 1F1B (Narayanan et al. 2021, §2.2; ``ScheduleInterleaved1F1B``): rank ``r`` holds
``v = pp_virtual_stages`` chunks of ``L / (pp * v)`` layers, the stages ``r, r + pp, ...`` (loop
placement); the embedding is in stage 0 (rank 0), the loss in stage ``pp * v - 1`` (rank
``pp - 1``). The rank runs its chunks' forwards and backwards in the order
`interleaved_actions` derives from torch's ``_get_1f1b_rank_ops``. Each chunk has its own
receive buffers (all ``m`` micro-batches, kept for the run). ``_PipelineScheduleRuntime`` keeps
every send's work (``send_ops``) to the end of ``step()``: the chunk outputs sent forward and
the input gradients sent back stay alive to the end of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from calc.config.jobs import Training
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism, layers_per_stage
from calc.models import reference
from calc.replay import ops
from calc.replay.tape import Event, Tape, Tensor
from calc.step import training as step_mod
from calc.step.optimizer import OptimizerTail
from calc.step.sizes import values_for


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """What one pipeline rank runs (the structure of its replay)."""

    stage: int
    """This rank's stage index, 0 (embedding) to ``stages - 1`` (loss)."""
    stages: int
    """Pipeline degree ``pp``."""
    n_layers: int
    """Layers held by this stage."""
    microbatches: int
    """Micro-batches per step, ``m``."""
    schedule: str
    """``gpipe``, ``1f1b`` or ``interleaved-1f1b``."""
    virtual: int = 1
    """Chunks (virtual stages) on this rank, ``pp_virtual_stages``; ``n_layers / virtual``
    layers each (interleaved 1F1B only)."""

    def chunk_index(self, k: int) -> int:
        """The global stage index of local chunk ``k`` (loop placement: ``stage + k * pp``)."""
        return self.stage + k * self.stages

    def chunk_first(self, k: int) -> bool:
        """Whether local chunk ``k`` holds the embedding (global stage 0)."""
        return self.chunk_index(k) == 0

    def chunk_last(self, k: int) -> bool:
        """Whether local chunk ``k`` holds the loss (global stage ``pp * v - 1``)."""
        return self.chunk_index(k) == self.stages * self.virtual - 1

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


def check_pipeline(model: ModelSpec, job: Training, parallel: Parallelism) -> None:
    """Raise ``ValueError`` for a layout the schedule cannot run and ``NotImplementedError``
    for one this module does not replay."""
    m = parallel.pp_microbatches
    if job.micro_batch % m:
        raise ValueError(
            f"pp_microbatches={m} must divide micro_batch={job.micro_batch} (the schedule "
            "splits the batch into equal micro-batches)"
        )
    if parallel.pp_schedule == "1f1b" and m < parallel.pp:
        raise ValueError(
            f"pp_microbatches={m} must be >= pp={parallel.pp} for 1F1B "
            "(torch.distributed.pipelining.Schedule1F1B)"
        )
    if parallel.pp_schedule == "interleaved-1f1b":
        chunks = parallel.pp * parallel.pp_virtual_stages
        if model.n_layers % chunks:
            raise ValueError(
                f"n_layers={model.n_layers} must be a multiple of pp={parallel.pp} x "
                f"pp_virtual_stages={parallel.pp_virtual_stages} = {chunks} for the interleaved "
                "1F1B schedule (every chunk holds the same layers; uneven chunks not modelled)"
            )
        rounds = max(1, m // parallel.pp)
        if m % rounds:  # ScheduleInterleaved1F1B.__init__
            raise ValueError(
                f"pp_microbatches={m} must be a multiple of the number of rounds "
                f"max(1, pp_microbatches // pp) = {rounds} (ScheduleInterleaved1F1B)"
            )
    if model.model_type == "gpt2" or model.tied_embeddings:
        raise NotImplementedError("pipeline stages are modelled for untied llama-family models")
    if job.implementation != "reference":
        raise NotImplementedError("pipeline parallelism is modelled for implementation='reference'")
    if job.recompute == "op":
        raise NotImplementedError(
            "pipeline parallelism with recompute='op' (recorded from transformers' code, which "
            "has no pipeline stages here)"
        )
    if job.precision == "amp-fp16":
        raise NotImplementedError(
            "pipeline parallelism with amp-fp16 (a GradScaler over the schedule's losses) is not "
            "modelled; amp-bf16 is"
        )
    if job.grad_accum != 1:
        raise NotImplementedError(
            "pipeline parallelism with grad_accum > 1 (the schedule's pp_microbatches are the "
            "accumulation)"
        )
    if job.loop != "drop-output" or job.loss != "cross-entropy" or job.optimizer_in_backward:
        raise NotImplementedError(
            "pipeline parallelism with another loop or loss, or optimizer_in_backward"
        )


def stage_plans(model: ModelSpec, job: Training, parallel: Parallelism) -> list[StagePlan]:
    """The plan of every pipeline stage (uneven layer counts as `layers_per_stage` splits)."""
    check_pipeline(model, job, parallel)
    counts = layers_per_stage(model.n_layers, parallel)
    return [
        StagePlan(stage=r, stages=parallel.pp, n_layers=counts[r],
                  microbatches=parallel.pp_microbatches, schedule=parallel.pp_schedule,
                  virtual=parallel.pp_virtual_stages)
        for r in range(parallel.pp)
    ]  # fmt: skip


def microbatch_job(job: Training, parallel: Parallelism) -> Training:
    """The job of one micro-batch (``micro_batch / pp_microbatches`` sequences): the symbol
    ``b`` of a stage replay is the micro-batch's size."""
    return replace(job, micro_batch=job.micro_batch // parallel.pp_microbatches)


def schedule_actions(plan: StagePlan) -> list[tuple[str, int]]:
    """``("F", i)`` / ``("B", i)`` in the order the stage runs them.

    GPipe: ``F0 .. F(m-1), B0 .. B(m-1)``. 1F1B (``Schedule1F1B._step_microbatches``):
    ``w = min(m, pp - r)`` warm-up forwards, then ``B, F`` pairs until every forward ran, then
    the remaining backwards."""
    m = plan.microbatches
    if plan.schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(m, plan.stages - plan.stage)
    out = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while True:
        out.append(("B", b))
        b += 1
        if f == m:
            break
        out.append(("F", f))
        f += 1
    out.extend(("B", i) for i in range(b, m))
    return out


def interleaved_actions(plan: StagePlan) -> list[tuple[str, int, int]]:
    """``(kind, micro-batch, local chunk)`` in the order rank ``plan.stage`` runs them under
    ``ScheduleInterleaved1F1B`` (torch 2.13 ``_calculate_single_rank_operations`` and
    ``_get_1f1b_rank_ops``, the idle slots left out).

    ``rounds = max(1, m // pp)``, ``k = m / rounds`` micro-batches per round; the rank warms up
    with ``w = min((v - 1) k + 2 (pp - 1 - r), m v)`` forwards; then each op runs a forward and
    a backward, then the remaining ``w`` backwards. Op ``o``'s forward runs chunk
    ``(o // k) % v``, its backward chunk ``v - 1 - ((o - w) // k) % v``; micro-batches are
    numbered per chunk in order."""
    pp, v, m, r = plan.stages, plan.virtual, plan.microbatches, plan.stage
    per_round = m // max(1, m // pp)
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - r), total)
    fwd_mb = [0] * v
    bwd_mb = [0] * v
    out: list[tuple[str, int, int]] = []

    def forward(op: int) -> None:
        k = (op // per_round) % v
        out.append(("F", fwd_mb[k], k))
        fwd_mb[k] += 1

    def backward(op: int) -> None:
        k = v - 1 - ((op - warmup) // per_round) % v
        out.append(("B", bwd_mb[k], k))
        bwd_mb[k] += 1

    for op in range(total + warmup):
        if op < warmup:
            forward(op)
        elif op < total:
            forward(op)
            backward(op)
        else:
            backward(op)
    return out


def in_flight(plan: StagePlan) -> int:
    """Most micro-batches whose activations the stage holds at once (forwards run, backwards
    not yet): ``m`` for GPipe, ``min(m, pp - r)`` for 1F1B (Narayanan et al. 2021, §2.2).
    Interleaved 1F1B counts chunk micro-batches (each ``1 / v`` of the rank's layers): rank 0
    holds ``v pp + pp - 1`` of them when ``pp`` divides ``m``, i.e. ``pp (1 + (pp - 1) /
    (pp v))`` micro-batches of the rank's layers (Korthikanti et al. 2022, §4.2.3)."""
    if plan.schedule == "interleaved-1f1b":
        acts = [kind for kind, _, _ in interleaved_actions(plan)]
    else:
        acts = [kind for kind, _ in schedule_actions(plan)]
    live = peak = 0
    for kind in acts:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def replay_stage(
    model: ModelSpec, job: Training, plan: StagePlan, device: str,
    n_layers: int | None = None, tp_comm: bool = False, grad_order: list | None = None,
) -> list[Event]:  # fmt: skip
    """Replay two optimizer steps of one pipeline stage; ``job`` is the micro-batch job
    (`microbatch_job`). Sizes are symbolic, ``b`` being the micro-batch's sequences.
    ``n_layers``: layers replayed (default the stage's; 5 stand for any number, as
    `calc.replay.timeline` generalises). ``tp_comm``: the stage's layers are one tensor-parallel
    rank's (`calc.parallel.tensor`). ``grad_order``, when given, receives the stage's parameters
    in the order their gradients become ready in the first backward (DDP's buckets)."""
    if plan.schedule == "interleaved-1f1b":
        return _replay_interleaved(model, job, plan, device, tp_comm, grad_order)
    layers = plan.n_layers if n_layers is None else n_layers
    tape, sh, w, keep, shapes, cos, sin = _stage_tape(model, job, plan, device, tp_comm, layers)
    _record_order(tape, keep, grad_order)
    recv_act: list[Tensor] = []
    recv_grad: list[Tensor] = []
    chunks: list[Tensor] = []
    tail = OptimizerTail(job, device, keep, shapes, values_for(model, job))
    for step in (1, 2):
        chunks = _begin_step(tape, step, chunks)
        if step == 1:
            recv_act, recv_grad = _recv_buffers(tape, sh, plan)
        cache: dict[int, Tensor] = {}
        losses: dict[int, Tensor] = {}
        sent: list[Tensor] = []  # tensors still held by the schedule's send lists
        held = _warmup_send(plan)
        warm: list[Tensor] = []  # the stage output the warm-up's last fired send still holds
        forwards = 0
        for kind, i in schedule_actions(plan):
            if kind == "F":
                out = _stage_forward(tape, sh, w, plan, cos, sin, recv_act[i] if recv_act else None)
                cache[i] = out
                forwards += 1
                if i == held:
                    warm.append(tape.alias(out))
                if plan.schedule == "gpipe" and not plan.last:  # fwd_sends_to_wait holds it
                    sent.append(tape.alias(out))
                if plan.last:
                    losses[i] = _loss(tape, sh, out, chunks)
                continue
            out = cache.pop(i)
            _backward(
                tape, out, losses[i] if plan.last else None, recv_grad[i] if recv_grad else None
            )
            if recv_act:  # the input's gradient: read from .grad, set to None, sent
                sent.append(tape.grads.pop(id(recv_act[i].storage)))
                if plan.schedule == "1f1b" and len(sent) > 1:
                    tape.drop(sent.pop(0))  # the previous send's ops are replaced
            if forwards == plan.microbatches:  # the 1B1F loop breaks: send_work is replaced
                tape.drop(*warm)
                warm = []
        _end_step(tape, plan, step, sent, [*losses.values()], chunks, tail)
    return tape.events


def _loss(tape: Tape, sh: reference.Shape, logits: Tensor, chunks: list[Tensor]) -> Tensor:
    """The last stage's loss of one micro-batch (``output_chunks`` keeps its logits)."""
    chunks.append(tape.alias(logits))
    tape.segment = "head"
    flat = ops.view(tape, logits)
    loss = ops.cross_entropy(tape, flat, sh.b * sh.s, sh.V, logits.itemsize)
    tape.drop(flat)
    return loss


def _backward(tape: Tape, out: Tensor, loss: Tensor | None, seed: Tensor | None) -> None:
    """One micro-batch's backward: from its loss (last stage) or from its stage output seeded
    with the received gradient; the output is dropped after."""
    if loss is not None:
        tape.segment = "head"
        tape.backward(loss)
    else:
        assert seed is not None, "a stage before the last is seeded by the next stage"
        tape.segment = "pipeline"
        tape.backward(out, seed=seed)
    tape.drop(out)


def _record_order(tape: Tape, params: list[Tensor], order: list | None) -> None:
    """Append to ``order`` each of the stage's ``params`` when its gradient is first ready (the
    receive buffers are leaves too, but no parameter: DDP does not bucket them)."""
    if order is None:
        return
    mine = {id(p.storage) for p in params}
    seen: set[int] = set()

    def hook(tape: Tape, leaf: Tensor) -> None:
        key = id(leaf.storage)
        if key in mine and key not in seen:
            seen.add(key)
            order.append(leaf)

    assert tape.grad_hook is None, "a stage's tape has no other gradient hook"
    tape.grad_hook = hook


def _warmup_send(plan: StagePlan) -> int | None:
    """The micro-batch whose stage output outlives its backward under 1F1B, or None.

    ``Schedule1F1B._step_microbatches`` fires the send of every warm-up forward but the last
    (``send_work = _batch_p2p(fwd_sends)``) and replaces ``send_work`` only after its 1B1F loop
    breaks. The Work of the last one fired, micro-batch ``w - 2``, holds the output it sends
    (a Work keeps its tensor; measured on gloo ranks), so that output lives from its forward
    until the first backward after the last forward, past its own backward. The last stage
    sends nothing; with ``w < 2`` no warm-up send is fired."""
    if plan.schedule != "1f1b" or plan.last:
        return None
    warmup = min(plan.microbatches, plan.stages - plan.stage)
    return warmup - 2 if warmup >= 2 else None


def _begin_step(tape: Tape, step: int, chunks: list[Tensor]) -> list[Tensor]:
    """The schedule's ``step`` begins: ``clear_runtime_states`` drops the last step's output
    chunks; the new step's list starts empty."""
    tape.phase = f"step{step}/forward"
    tape.segment = "pipeline"
    tape.drop(*chunks)
    return []


def _end_step(
    tape: Tape, plan: StagePlan, step: int, sent: list[Tensor], losses: list[Tensor],
    chunks: list[Tensor], tail: OptimizerTail,
) -> None:  # fmt: skip
    """The schedule's ``step`` returns: its send lists and losses die; the last stage's
    ``merge_chunks`` concatenates the micro-batches' logits (``torch.cat``), returned and
    dropped. Then the optimizer step (``tail``)."""
    tape.drop(*sent, *losses)
    if plan.last:
        tape.segment = "head"
        merged = tape.new(
            plan.microbatches * chunks[0].numel, chunks[0].itemsize, "pp.merged_logits"
        )
        tape.drop(merged)
    tape.phase = f"step{step}/optimizer"
    tape.segment = "optimizer"
    tail.step(tape, first_step=step == 1)


def _recv_buffers(
    tape: Tape, sh: reference.Shape, plan: StagePlan
) -> tuple[list[Tensor], list[Tensor]]:
    """The stage's receive buffers, made by its first step (``PipelineStage`` allocates them
    once and keeps them): one activation ``[b, s, h]`` per micro-batch unless it is the first
    stage (a leaf: its ``.grad`` is what is sent back), one gradient per micro-batch unless it
    is the last."""
    act = sh.b * sh.s * sh.h
    recv_act: list[Tensor] = []
    for _ in range(plan.microbatches if not plan.first else 0):
        t = tape.new(act, sh.act_itemsize, "pp.recv_act", "buffer")
        t.leaf = True
        tape.leaves[id(t.storage)] = t
        recv_act.append(t)
    recv_grad = [
        tape.new(act, sh.act_itemsize, "pp.recv_grad", "buffer")
        for _ in range(plan.microbatches if not plan.last else 0)
    ]
    return recv_act, recv_grad


def _stage_tape(
    model: ModelSpec, job: Training, plan: StagePlan, device: str, tp_comm: bool, layers: int
) -> tuple:
    """The tape a pipeline rank starts from: only its stages' parameters live (with their
    optimizer shapes), the token ids and targets of all ``m`` micro-batches, and the RoPE
    buffers. Returns ``(tape, shape, weights, kept params, their shapes, cos, sin)``."""
    sh = step_mod.shape_for(model, job, device, layers, tp_comm)
    m = plan.microbatches
    tape = Tape(inplace_accumulate=device == "cuda")
    w = reference.Weights(tape, sh)
    keep = _stage_params(w, plan)
    kept = {id(p.storage) for p in keep}
    for p in w.parameters():  # the other stages' parameters are not on this rank
        if id(p.storage) not in kept:
            tape.live.pop(id(p.storage), None)
    shapes = [s for p, s in zip(w.parameters(), w.shapes(sh), strict=True)
              if id(p.storage) in kept]  # fmt: skip
    idx = step_mod.INDEX_ITEMSIZE
    tape.existing(m * sh.b * sh.s, idx, "input_ids", "input")
    tape.existing(m * sh.b * sh.s, idx, "targets", "input")
    cos = tape.existing(sh.s * sh.d, sh.weight_itemsize, "rope_cos", "buffer")
    sin = tape.existing(sh.s * sh.d, sh.weight_itemsize, "rope_sin", "buffer")
    return tape, sh, w, keep, shapes, cos, sin


def _replay_interleaved(
    model: ModelSpec, job: Training, plan: StagePlan, device: str, tp_comm: bool,
    grad_order: list | None,
) -> list[Event]:  # fmt: skip
    """`replay_stage` for interleaved 1F1B: every layer of the rank replayed (chunk ``k`` runs
    layers ``k L_r / v .. (k + 1) L_r / v - 1`` of the rank's ``L_r``), the actions in
    `interleaved_actions` order, every send held to the end of the step."""
    m, v = plan.microbatches, plan.virtual
    per_chunk = plan.n_layers // v
    tape, sh, w, keep, shapes, cos, sin = _stage_tape(
        model, job, plan, device, tp_comm, plan.n_layers
    )
    _record_order(tape, keep, grad_order)
    act = sh.b * sh.s * sh.h
    recv_act: dict[tuple[int, int], Tensor] = {}
    recv_grad: dict[tuple[int, int], Tensor] = {}
    chunks: list[Tensor] = []
    tail = OptimizerTail(job, device, keep, shapes, values_for(model, job))
    for step in (1, 2):
        chunks = _begin_step(tape, step, chunks)
        if step == 1:  # each chunk's PipelineStage allocates its buffers
            for k in range(v):
                for i in range(m if not plan.chunk_first(k) else 0):
                    t = tape.new(act, sh.act_itemsize, "pp.recv_act", "buffer")
                    t.leaf = True
                    tape.leaves[id(t.storage)] = t
                    recv_act[k, i] = t
                for i in range(m if not plan.chunk_last(k) else 0):
                    recv_grad[k, i] = tape.new(act, sh.act_itemsize, "pp.recv_grad", "buffer")
        cache: dict[tuple[int, int], Tensor] = {}
        losses: dict[tuple[int, int], Tensor] = {}
        sent: list[Tensor] = []  # send_ops: every send's tensor, to the end of step()
        for kind, i, k in interleaved_actions(plan):
            last = plan.chunk_last(k)
            if kind == "F":
                chunk = replace(plan, stage=plan.chunk_index(k), stages=plan.stages * v,
                                n_layers=per_chunk, virtual=1)  # fmt: skip
                layers = w.layers[k * per_chunk : (k + 1) * per_chunk]
                out = _stage_forward(tape, sh, w, chunk, cos, sin, recv_act.get((k, i)), layers)
                cache[k, i] = out
                if last:
                    losses[k, i] = _loss(tape, sh, out, chunks)
                else:
                    sent.append(tape.alias(out))
                continue
            out = cache.pop((k, i))
            _backward(tape, out, losses.get((k, i)) if last else None, recv_grad.get((k, i)))
            if (k, i) in recv_act:  # the input's gradient: read from .grad, set to None, sent
                sent.append(tape.grads.pop(id(recv_act[k, i].storage)))
        _end_step(tape, plan, step, sent, [*losses.values()], chunks, tail)
    return tape.events


def _stage_params(w: reference.Weights, plan: StagePlan) -> list[Tensor]:
    out = [w.embed] if plan.first else []
    for lw in w.layers:
        out.extend(t for t in lw.values() if t is not None)
    if plan.last:
        out.extend([w.norm, w.head])
    return out


def _stage_forward(
    tape: Tape, sh: reference.Shape, w: reference.Weights, plan: StagePlan, cos: Tensor,
    sin: Tensor, received: Tensor | None, layers: list | None = None,
) -> Tensor:  # fmt: skip
    """``StageModule.forward`` (verify/dist/pp_plans.py): embedding (first stage), the layers
    (``layers``, default all of ``w``; each checkpointed under ``recompute="full"``), norm and
    head (last stage); returns the stage output. Under ``amp-*`` the stage's forward runs in
    ``torch.autocast`` and leaves it before the schedule calls the loss: the weight-cast cache
    is cleared at every micro-batch's exit, so each micro-batch in flight keeps its own
    low-precision copies of the weights its linears saved."""
    n = sh.b * sh.s
    if sh.autocast_itemsize:
        tape.autocast_enter(sh.autocast_itemsize)
    if plan.first:
        tape.segment = "embed"
        x = ops.embedding(tape, w.embed, n, sh.h, "embed_out")
    else:
        assert received is not None, "a stage after the first receives its input"
        x = tape.alias(received)
        x.leaf = True  # the receive buffer is a leaf that requires grad
    for j, lw in enumerate(w.layers if layers is None else layers):
        tape.segment = j
        if sh.recompute == "full":

            def run(x: Tensor = x, lw: dict = lw) -> Tensor:
                return reference.block(tape, sh, x, lw, cos, sin)

            x_next = tape.checkpoint(run, [x])
        else:  # selective: the attention core is checkpointed inside the block
            x_next = reference.block(tape, sh, x, lw, cos, sin)
        tape.drop(x)
        x = x_next
    if plan.last:
        tape.segment = "head"
        hid = reference.norm(tape, sh, x, w.norm, None, n)
        tape.drop(x)
        x = ops.linear(tape, hid, w.head, None, n, sh.V, "logits")
        tape.drop(hid)
    tape.autocast_exit()
    return x
