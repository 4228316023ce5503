"""Knowledge distillation in the training replay: what `verify.models.distill` runs, tensor by tensor.

Before the step: the teacher's weights (``teacher_precision``, no gradients, no optimizer
states) and its RoPE tables ``[s, d_t]``. Each micro-batch:

1. the teacher's forward under ``torch.inference_mode()`` (or ``no_grad``: the same storages,
   measured) (`teacher_logits`): every layer's tensors
   die as soon as their Python reference does (nothing is saved), so a layer costs its
   largest transient once and the teacher's logits ``[b*s, V_teacher]`` are what is left
   (a teacher with a larger, padded vocabulary is sliced to the student's, a view);
2. the student's forward up to its logits (`calc.models.reference.logits`);
3. the loss (`kd_loss`): ``log_softmax`` of the student (saved), ``softmax`` of the teacher
   (saved by the KL's product), ``at::kl_div`` = ``xlogy(t, t) - t * logp`` summed
   (``aten/src/ATen/native/Loss.cpp``, CompositeImplicitAutograd: the product, the xlogy and
   the difference are three more logits-sized temporaries), ``/ rows`` (``batchmean``), and
   ``T != 1`` divisions, ``T^2`` and the hard cross entropy when asked.

Under ``amp-bf16`` the teacher's forward runs inside the student's autocast too (its frozen
weights, not leaves that need grad, are cast at every call) and ``kl_div``, on autocast's fp32
list, casts its input and target to fp32 (`kl_div_batchmean`). ``amp-fp16`` is refused: its
GradScaler skips steps whose gradients overflow, which the fp16 KD loss did when measured.

The teacher's layers are identical and hold nothing across layers under ``no_grad``, so two of
them are replayed and the weights of the others are one storage of their summed bytes (each
tensor rounded as allocated). Teacher tensors are tagged ``teacher`` (never a student layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from calc import symbols as S
from calc.compress.lora import compress_weights
from calc.config.distill import TEACHER_ITEMSIZE, Distill
from calc.config.jobs import Training
from calc.models import reference
from calc.models.attention import attention_kernel
from calc.replay import ops
from calc.replay.tape import Node, Size, Tape, Tensor

TEACHER = "teacher"
"""Tag and tape category of the teacher's storages (breakdown ``teacher/...``)."""
TEACHER_LAYERS_REPLAYED = 2
INDEX_ITEMSIZE = 8


@dataclass(slots=True)
class Teacher:
    """The teacher on the tape: its shape, weights and RoPE tables."""

    sh: reference.Shape
    w: reference.Weights
    cos: Tensor | None
    sin: Tensor | None
    distill: Distill


def _distill(job: Training) -> Distill:
    """``job.distill``; ``ValueError`` for a job that does not distill."""
    if job.distill is None:
        raise ValueError("job.distill is None: not a distillation job")
    return job.distill


def check(job: Training) -> None:
    """Raise ``NotImplementedError`` for a distillation job the replay does not cover."""
    if job.implementation != "reference":
        raise NotImplementedError("distill with implementation='hf' is not modelled yet")
    if job.precision == "amp-fp16":
        raise NotImplementedError(
            "distill with precision='amp-fp16' is not modelled: GradScaler skips optimizer "
            "steps whose gradients overflow (measured: the fp16 KD loss at the initial scale "
            "65536 skipped a step, so no optimizer states), a data-dependent path"
        )
    if job.precision.startswith("amp-") and _distill(job).teacher_quant is not None:
        raise NotImplementedError(
            f"distill with a quantized teacher under precision={job.precision!r} is not "
            "modelled yet"
        )
    if job.lora is not None or job.quant is not None:
        raise NotImplementedError("distill together with lora/quant is not modelled yet")


def setup(tape: Tape, student: reference.Shape, job: Training, device: str) -> Teacher:
    """The teacher's weights and RoPE tables, alive before the step (built at setup)."""
    d = _distill(job)
    t = d.teacher
    # The teacher's vocabulary is a number of its own (the student's, V, may be smaller: the
    # loss slices the teacher's logits); never the student's symbol, which the compiled replay
    # shares with students of other vocabularies.
    vocab = t.vocab
    itemsize = TEACHER_ITEMSIZE[d.teacher_precision]
    kernel = student.attention if device == "cpu" else attention_kernel(t, job)
    sh = reference.Shape(
        b=S.b, s=S.s, h=t.hidden, a=t.n_heads, k=t.n_kv_heads, d=t.head_dim, f=t.ffn, V=vocab,
        P=t.max_positions if t.learned_positions else 0,
        n_layers=min(t.n_layers, TEACHER_LAYERS_REPLAYED),
        model_type=t.model_type, mlp=t.mlp, norm=t.norm, qkv_bias=t.qkv_bias,
        o_bias=t.o_bias, mlp_bias=t.mlp_bias, norm_bias=t.norm_bias, qk_norm=t.qk_norm,
        tied=t.tied_embeddings, weight_itemsize=itemsize, act_itemsize=itemsize,
        attention=kernel, device=device, gqa=t.n_kv_heads != t.n_heads,
    )  # fmt: skip
    before = set(tape.live)
    w = reference.Weights(tape, sh)
    for p in w.parameters():  # frozen: requires_grad_(False), not the student's leaves
        p.leaf = False
        tape.leaves.pop(id(p.storage), None)
    if d.teacher_quant is not None:
        # packed linears + scales (calc.compress.quant), as verify.models.compress
        compress_weights(tape, w, sh, None, d.teacher_quant, d.teacher_precision)
    own = [st for key, st in tape.live.items() if key not in before]
    per_layer = sum(int(st.size) for st in own if st.tag == 0)
    for st in own:
        st.kind, st.tag, st.name = TEACHER, TEACHER, "weights"
    if t.n_layers > sh.n_layers:
        rest = (t.n_layers - sh.n_layers) * per_layer
        tape.existing(rest, 1, "weights", TEACHER, tag=TEACHER)
    rope = not t.learned_positions
    cos = tape.existing(S.s * t.head_dim, itemsize, "rope", TEACHER, tag=TEACHER) if rope else None
    sin = tape.existing(S.s * t.head_dim, itemsize, "rope", TEACHER, tag=TEACHER) if rope else None
    return Teacher(sh, w, cos, sin, d)


def teacher_logits(tape: Tape, teacher: Teacher) -> Tensor:
    """``F.linear(teacher.hidden_states(ids), teacher.head_weight())`` under inference mode (grad off)."""
    sh, w = teacher.sh, teacher.w
    n = sh.b * sh.s
    segment, grad = tape.segment, tape.grad_enabled
    tape.segment, tape.grad_enabled = TEACHER, False
    x, pos = reference.embed_no_grad(tape, sh, w)  # GPT-2's positions: a local until the end
    for lw in w.layers:
        x_next = reference.block(tape, sh, x, lw, teacher.cos, teacher.sin)
        tape.drop(x)
        x = x_next
    hid = reference.norm(tape, sh, x, w.norm, w.norm_b, n)
    tape.drop(x, pos)  # hidden_states returns: its locals die
    out = ops.linear(tape, hid, w.head, None, n, sh.V, "teacher_logits")
    tape.drop(hid)
    tape.segment, tape.grad_enabled = segment, grad
    return out


def _scalar_op(tape: Tape, x: Tensor, name: str) -> Tensor:
    """``x * c`` or ``x / c`` for a Python number ``c``: the result is x-sized; backward
    ``grad * c`` (or ``/ c``) allocates the gradient (the wrapped scalar is saved, not x)."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [tape.new(g.numel, g.itemsize, f"d{name}") if g is not None else None]

    n = tape.node("MulScalar", rule, [x])
    return tape.output(tape.new(x.numel, x.itemsize, name), n)


def _promoted(a: int, b: int, same_dtype: bool) -> int:
    """Itemsize of a binary op's result: two different float dtypes promote to fp32 (bf16 with
    fp16 included), equal ones stay."""
    return a if same_dtype else 4


def kl_div_batchmean(tape: Tape, logp: Tensor, p_t: Tensor, rows: Size, same: bool) -> Tensor:
    """``F.kl_div(logp, p_t, reduction="batchmean")``: ``torch.kl_div(..., sum)`` then
    ``/ rows``; ``at::kl_div`` is ``xlogy(t, t) - t * input`` (product first, as traced).

    Under autocast ``kl_div`` is on the fp32 list (CPU and CUDA): its input, then its target,
    are cast to fp32 first (the input's cast casts the gradient back in backward; the target's
    copy is what the product saves); both casts die when the op returns. Traced on torch 2.13
    CPU: ``log_softmax`` and ``softmax`` themselves stay in bf16 there."""
    casts: list[Tensor] = []
    if tape.autocast_itemsize:
        logp = ops.to_dtype(tape, logp, 4, "kl.input.float")
        p_t = ops.to_dtype(tape, p_t, 4, "kl.target.float")
        casts, same = [logp, p_t], True
    out_itemsize = _promoted(logp.itemsize, p_t.itemsize, same)
    prod = ops.mul(tape, p_t, logp, "kl.t_logp", out_itemsize=out_itemsize)  # saves p_t
    xlogy = tape.new(p_t.numel, p_t.itemsize, "kl.xlogy")  # target needs no grad: no node

    def sub_rule(tape: Tape, node: Node, grads: list) -> list:
        g = grads[0]
        return [None, tape.new(g.numel, g.itemsize, "dkl.neg")]  # -grad (expanded: full size)

    n = tape.node("Sub", sub_rule, [xlogy, prod])
    diff = tape.output(tape.new(p_t.numel, out_itemsize, "kl.diff"), n)
    tape.drop(prod, xlogy)

    def sum_rule(tape: Tape, node: Node, grads: list) -> list:
        return [tape.alias(grads[0], numel=node.info["numel"])]  # grad.expand(sizes): a view

    n = tape.node("Sum", sum_rule, [diff], numel=diff.numel)
    total = tape.output(tape.new(1, out_itemsize, "kl.sum"), n)
    tape.drop(diff, *casts)
    loss = _scalar_op(tape, total, "kl.batchmean")
    tape.drop(total)
    return loss


def kd_loss(
    tape: Tape, sh: reference.Shape, s_logits: Tensor, t_logits: Tensor, d: Distill
) -> Tensor:
    """`verify.models.distill.kd_loss` on the tape (student logits need grad, teacher's do not)."""
    n = sh.b * sh.s
    same = s_logits.itemsize == t_logits.itemsize and d.teacher_precision != "fp16"
    s = ops.view(tape, s_logits)  # flatten(0, 1)
    t = tape.alias(t_logits, numel=s_logits.numel)  # flatten(0, 1)[:, :V]: a view
    if d.temperature != 1:
        s2 = _scalar_op(tape, s, "student_logits/T")
        t2 = tape.new(t.numel, t.itemsize, "teacher_logits/T")
        tape.drop(s, t)
        s, t = s2, t2
    logp = ops.log_softmax(tape, s, s.itemsize)
    tape.drop(s)
    p_t = tape.new(t.numel, t.itemsize, "teacher_probs")  # softmax, no grad
    tape.drop(t)
    loss = kl_div_batchmean(tape, logp, p_t, n, same)
    tape.drop(logp, p_t)
    if d.temperature != 1:
        scaled = _scalar_op(tape, loss, "kd.T2")
        tape.drop(loss)
        loss = scaled
    if d.hard_weight > 0:
        flat = ops.view(tape, s_logits)
        ce = ops.cross_entropy(tape, flat, n, sh.V, s_logits.itemsize)
        tape.drop(flat)
        weighted = _scalar_op(tape, ce, "hard.weighted")
        total = ops.add(tape, loss, weighted, "kd.total")
        tape.drop(weighted, loss, ce)
        loss = total
    return loss


def forward(
    tape: Tape, sh: reference.Shape, w: reference.Weights, cos: Tensor | None,
    sin: Tensor | None, teacher: Teacher,
) -> Tensor:  # fmt: skip
    """The distillation loss function of `verify.models.distill.wrap` for one micro-batch."""
    t_logits = teacher_logits(tape, teacher)
    s_logits = reference.logits(tape, sh, w, cos, sin)
    loss = kd_loss(tape, sh, s_logits, t_logits, teacher.distill)
    tape.drop(t_logits, s_logits)  # the loss function's locals
    return loss
