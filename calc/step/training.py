"""The training step the cost model replays: the loop of ``verify/run/step.py``, event by event.

For step in (1, 2) (the first creates optimizer states, the second is steady): for each
micro-batch, forward (under autocast for ``amp-*``) and backward; then the optimizer step and
``zero_grad(set_to_none=True)`` (or ``zero_grad`` just before the first backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from calc import symbols as S
from calc.compress import distill, litgpt_lora, nf4_torchao, prune_replay
from calc.compress.lora import LINEAR_KEYS, compress_weights
from calc.compress.quant import library_of
from calc.config.jobs import Training
from calc.config.model_spec import ModelSpec
from calc.models import hf, hf_gpt2, litgpt, reference, torchtitan, torchtune
from calc.models.attention import compute_16bit_of, flash_head_pad, kernel_for
from calc.models.head import Head
from calc.models.litgpt_arch import arch_of
from calc.parallel import data as data_parallel
from calc.parallel.data import ReplayPlan
from calc.parallel.fsdp import Fsdp
from calc.parallel.fsdp1 import Fsdp1
from calc.replay import ops
from calc.replay.offload import Offload
from calc.replay.tape import Event, Tape, Tensor, divide
from calc.step.optimizer import OptimizerTail, SizeValues
from calc.step.sizes import values_for

WEIGHT_ITEMSIZE = {"fp32": 4, "amp-bf16": 4, "amp-fp16": 4, "bf16": 2, "bf16-master": 2}
AUTOCAST_ITEMSIZE = {"amp-bf16": 2, "amp-fp16": 2}
INDEX_ITEMSIZE = 8  # int64 token ids and targets


def shape_for(
    model: ModelSpec, job: Training, device: str, n_layers: int,
    tp_comm: bool = False, tp_vocab: bool = False, sp: int = 1,
) -> reference.Shape:  # fmt: skip
    """The replay's symbolic shape: sizes are the symbols of `calc.symbols`. ``tp_comm``: the
    model is one tensor-parallel rank's (`calc.parallel.tensor`), with its all-reduces."""
    p_attn = model.attention_dropout if job.dropout is None else job.dropout
    kernel = kernel_for(model, job, device, p_attn)
    p_hidden = model.hidden_dropout if job.dropout is None else job.dropout
    p_embed = model.embedding_dropout if job.dropout is None else job.dropout
    w = WEIGHT_ITEMSIZE[job.precision]
    return reference.Shape(
        b=S.b, s=S.s, h=S.h, a=S.a, f=S.f, V=S.V, P=S.P,
        # a * d == h (most models): d is written h / a so that shapes the code compares are
        # equal symbolically exactly when they are equal in the model.
        d=S.h / S.a if model.n_heads * model.head_dim == model.hidden else S.d,
        # Without GQA the kv heads are the query heads: one symbol, so that code choosing a
        # path on ``k == a`` (HF's repeat_kv / enable_gqa) replays the path the model takes.
        k=S.a if model.n_kv_heads == model.n_heads else (1 if model.n_kv_heads == 1 else S.k),
        n_layers=n_layers,
        model_type=model.model_type, mlp=model.mlp, norm=model.norm,
        qkv_bias=model.qkv_bias, o_bias=model.o_bias, mlp_bias=model.mlp_bias,
        norm_bias=model.norm_bias, qk_norm=model.qk_norm, tied=model.tied_embeddings,
        weight_itemsize=w, act_itemsize=w,
        autocast_itemsize=AUTOCAST_ITEMSIZE.get(job.precision, 0),
        attention=kernel, recompute=job.recompute, recompute_every=job.recompute_every,
        attn_dropout=p_attn, hidden_dropout=p_hidden, embed_dropout=p_embed, device=device,
        flash_head_pad=flash_head_pad(model.head_dim),
        gqa=model.n_kv_heads != model.n_heads, tp_comm=tp_comm, tp_vocab=tp_vocab, sp=sp,
    )  # fmt: skip


def replay_training(
    model: ModelSpec,
    job: Training,
    device: str,
    n_layers: int,
    tp_comm: bool = False,
    tp_vocab: bool = False,
    sp: int = 1,
    dp: ReplayPlan | None = None,
    grad_order: list | None = None,
) -> list[Event]:
    """Replay two optimizer steps of ``job`` with ``n_layers`` concrete layers (``tp_comm``:
    as one tensor-parallel rank, `calc.parallel.tensor`; ``dp``: as one data-parallel rank,
    `calc.parallel.data`). ``grad_order``, when given, receives the parameter leaves in the
    order their gradients become ready in the first backward.

    The story: `check_supported` refuses what the cost model does not cover, `build_step`
    lays out what exists before the first forward, `run_steps` replays the loop."""
    sh = shape_for(model, job, device, n_layers, tp_comm, tp_vocab, sp)
    if dp is not None and dp.param_itemsize:  # FSDP2 MixedPrecisionPolicy: bf16 compute
        _check_mixed_precision(job, dp)
        kernel = kernel_for(
            model, job, device, sh.attn_dropout, compute_16bit_of(dp.param_itemsize)
        )
        sh = replace(
            sh,
            weight_itemsize=dp.param_itemsize,
            act_itemsize=dp.param_itemsize,
            attention=kernel,
        )
    check_supported(model, job, sh, tp_comm, dp)
    setup = build_step(model, job, sh, device, dp)
    if grad_order is not None:
        setup.tape.grad_hook = _recording(setup.tape.grad_hook, grad_order)
    return run_steps(job, setup, device, dp, size_values=values_for(model, job))


def _check_mixed_precision(job: Training, dp: ReplayPlan) -> None:
    """Refuse what the FSDP2 ``MixedPrecisionPolicy`` replay (`calc.parallel.fsdp`) does not
    cover: it models an fp32 model (``precision='fp32'``) cast by the policy."""
    if job.precision != "fp32":
        raise ValueError(
            f"fsdp_param_dtype with precision={job.precision!r}: the policy casts an fp32 "
            "model (fp32 shards and optimizer states); use precision='fp32'"
        )
    others = (job.lora, job.quant, job.pruning, job.distill)
    if job.recompute == "selective" or any(x is not None for x in others) or dp.offload != "none":
        raise NotImplementedError(
            "FSDP2 mixed precision is modelled without selective recomputation, compression "
            "and offload"
        )


def _forward_path(model: ModelSpec, job: Training) -> ForwardPath:
    if job.implementation == "torchtune":
        return ForwardPath.TORCHTUNE
    if job.implementation == "torchtitan":
        return ForwardPath.TORCHTITAN
    if job.implementation == "litgpt":
        return ForwardPath.LITGPT
    if job.implementation != "hf":
        return ForwardPath.REFERENCE
    return ForwardPath.HF_GPT2 if model.model_type == "gpt2" else ForwardPath.HF


def _check_recorded_only(job: Training) -> None:
    """What only the replay recorded from transformers' code models (`calc.derive`), and
    torchtitan's replay its op-level checkpointing."""
    if job.compile != "none":
        raise NotImplementedError(
            f"compile={job.compile!r} on the hand-written graph: torch.compile's step is "
            "recorded from Inductor's own generated code (implementation 'hf' or 'derived')"
        )
    if job.recompute == "op" and job.implementation != "torchtitan":
        raise NotImplementedError(
            "recompute='op' on the hand-written graph: torchtitan's op-level selective "
            "checkpointing is recorded from transformers' code (implementation 'hf' or "
            "'derived') and replayed on torchtitan's model (implementation='torchtitan')"
        )
    if job.recompute_every != 1 and job.implementation != "torchtitan":
        raise NotImplementedError(
            f"recompute_every={job.recompute_every} on the hand-written graph: checkpointing "
            "some layers only is recorded from transformers' code (implementation 'hf' or "
            "'derived', every_n_layers) and replayed on torchtitan's model "
            "(implementation='torchtitan')"
        )


def _check_torchtune(sh: reference.Shape, job: Training, dp: ReplayPlan | None) -> None:
    """torchtune's model and recipe (`calc.models.torchtune.check`); its QLoRA's base is
    torchao's NF4Tensor (`calc.compress.nf4_torchao.check_job`)."""
    torchtune.check(sh, job, dp)
    if job.quant is not None:
        nf4_torchao.check_job(sh, job)


def _check_implementation(
    path: ForwardPath, sh: reference.Shape, job: Training, dp: ReplayPlan | None,
    model: ModelSpec,
) -> None:  # fmt: skip
    """The checks of the forward path's own replay (GPT-2, torchtune, torchtitan), and
    activation offloading, which only torchtune's replay covers by hand."""
    if path is ForwardPath.HF_GPT2:  # GPT2LMHeadModel: its own replay (dropout, math SDPA, eager)
        hf_gpt2.check(sh)
    if path is ForwardPath.TORCHTUNE:
        _check_torchtune(sh, job, dp)
    elif path is ForwardPath.TORCHTITAN:
        torchtitan.check(sh, job, dp)
    elif path is ForwardPath.LITGPT:
        litgpt.check(sh, job, dp)
        if job.lora is not None:
            litgpt_lora.check(sh, job, model)
    elif job.offload_activations:
        raise NotImplementedError(
            f"offload_activations with implementation={job.implementation!r}: transformers' "
            "activation_checkpointing_enable(offload=True) is recorded from its code "
            "(implementation 'hf' or 'derived'), torchtune's hooks replayed by hand "
            "(implementation='torchtune')"
        )


def check_supported(
    model: ModelSpec, job: Training, sh: reference.Shape, tp_comm: bool, dp: ReplayPlan | None
) -> None:
    """Raise ``NotImplementedError`` (naming the combination) for a job the replay does not
    model; ``ValueError`` for a GPT-2 shape Hugging Face's model would refuse."""
    path = _forward_path(model, job)
    _check_recorded_only(job)
    if tp_comm and job.implementation != "reference":
        raise NotImplementedError("tensor parallelism is modelled for implementation='reference'")
    _check_implementation(path, sh, job, dp, model)
    if path is ForwardPath.HF:
        if job.recompute == "selective":
            raise NotImplementedError(
                "recompute='selective' with implementation='hf': transformers checkpoints whole "
                "layers only (gradient_checkpointing_enable); use recompute='full'"
            )
        if max(sh.attn_dropout, sh.hidden_dropout, sh.embed_dropout) > 0:
            raise NotImplementedError(
                "implementation='hf' with dropout is not modelled yet; implementation='reference' "
                "(--implementation reference) models dropout, and dropout=0 the hf model"
            )
    if sh.attention == "eager" and sh.autocast_itemsize and path is not ForwardPath.HF_GPT2:
        raise NotImplementedError(
            "eager attention under autocast is not modelled yet; precision='bf16' or 'fp32' "
            "(no autocast) with eager attention is, and attention='sdpa' under autocast"
        )
    if job.distill is not None:
        distill.check(job)
    _check_head(job, sh, path, tp_comm, dp)
    if job.optimizer_in_backward and (
        dp is not None or tp_comm or job.grad_accum != 1
        or job.precision in ("amp-fp16", "bf16-master")
    ):  # fmt: skip
        raise NotImplementedError(
            "optimizer_in_backward is modelled on one GPU, with grad_accum=1 (torchtune refuses "
            "accumulation with it), without GradScaler or master weights"
        )
    if dp is not None and dp.fsdp and (job.recompute == "selective" or path is ForwardPath.HF_GPT2):
        raise NotImplementedError(
            "FSDP2 with selective recomputation or Hugging Face GPT-2 is not modelled yet"
        )


def _check_head(
    job: Training, sh: reference.Shape, path: ForwardPath, tp_comm: bool, dp: ReplayPlan | None
) -> None:
    """Refuse the loops and losses (`calc.models.head`) where they are not modelled. Under data
    parallelism (DDP, ZeRO, FSDP2) they are verified on Hugging Face models, whose loop calls
    the wrapped model (verify's reference loops call its submodules, around the wrapper); the
    chunked loss calls the base model around the wrapper too, and stays on one GPU. Under tensor
    parallelism (alone or in FSDP2's 2-D mesh) torchtitan's loop, ``del-logits`` with the
    cross-entropy (``loss_parallel``'s on a vocabulary-sharded head): verify's 2-D root calls
    the head as a module and returns the logits (``verify/dist/tp_plans.py``)."""
    if job.optimizer is None and tp_comm:
        raise NotImplementedError("optimizer=None is modelled on one GPU and under dp")
    own_loops = (ForwardPath.TORCHTUNE, ForwardPath.TORCHTITAN, ForwardPath.LITGPT)
    if Head.of(job).default or path in own_loops:
        return  # the recipes' own loops: torchtune.check, torchtitan.check
    what = f"loop={job.loop!r} with loss={job.loss!r}"
    if job.distill is not None or job.lora is not None or job.pruning is not None:
        raise NotImplementedError(f"{what} is modelled without distillation, LoRA and pruning")
    if tp_comm:
        if (
            job.loop != "del-logits"
            or job.loss != "cross-entropy"
            or (dp is not None and dp.shard_world > 1 and not dp.fsdp)
        ):
            raise NotImplementedError(
                f"{what} with tp: tensor parallelism (alone or with FSDP2) is modelled with "
                "torchtitan's loop, loop='del-logits' and loss='cross-entropy', or the default"
            )
        return
    if dp is not None and (path is not ForwardPath.HF or job.loss == "chunked-ce"):
        raise NotImplementedError(
            f"{what} under dp (DDP, ZeRO, FSDP2) is modelled for implementation='hf' "
            "Llama-family models, with loss 'cross-entropy' or 'sum'"
        )
    if job.loss == "sum" and sh.autocast_itemsize:
        raise NotImplementedError(
            "loss='sum' under autocast is not modelled (CUDA's autocast runs sum in fp32: a "
            "cast copy of the logits); use precision 'bf16' or 'fp32'"
        )


class ForwardPath(Enum):
    """Which model's forward the step replays."""

    REFERENCE = "reference"
    """`calc.models.reference` (with a distillation teacher: `calc.compress.distill`)."""
    HF = "hf"
    """Hugging Face llama-family models, `calc.models.hf`."""
    HF_GPT2 = "hf_gpt2"
    """Hugging Face ``GPT2LMHeadModel``, `calc.models.hf_gpt2`."""
    TORCHTUNE = "torchtune"
    """torchtune's Llama and its recipe's loss step, `calc.models.torchtune`."""
    TORCHTITAN = "torchtitan"
    """torchtitan's Llama 3 and its trainer's loss step, `calc.models.torchtitan`."""
    LITGPT = "litgpt"
    """LitGPT's Llama and its fine-tuning loop, `calc.models.litgpt`."""


@dataclass
class StepSetup:
    """What exists before the first forward of a replayed training step."""

    tape: Tape
    sh: reference.Shape
    w: reference.Weights
    path: ForwardPath
    sliding_layers: int
    """Layers with a sliding window (Hugging Face models): all or none."""
    cos: Tensor | None
    sin: Tensor | None
    teacher: distill.Teacher | None
    """`calc.compress.distill.setup`'s frozen teacher, or ``None``."""
    opt_params: list[Tensor]
    shapes: list
    fsdp: Fsdp | Fsdp1 | None
    ids: Tensor
    """The input token ids."""
    held: list[Tensor] = field(default_factory=list)
    """What the loop holds of the last forward's output (``loop="hold-output"``)."""
    regime: litgpt.Regime | None = None
    """litgpt's loss chunks and RoPE tables for the job's sizes (`calc.models.litgpt`)."""


def build_step(
    model: ModelSpec, job: Training, sh: reference.Shape, device: str, dp: ReplayPlan | None
) -> StepSetup:
    """The tape with the weights, pruning masks, teacher, adapters, inputs and RoPE tables, and
    the parameters the optimizer steps (sharded by ``dp``/FSDP2 when given)."""
    path = _forward_path(model, job)
    tape = Tape(inplace_accumulate=device == "cuda")
    own_order = path in (ForwardPath.TORCHTUNE, ForwardPath.TORCHTITAN)
    if path is ForwardPath.LITGPT:
        w: reference.Weights = litgpt.Weights(tape, sh, arch_of(model))
    else:
        w = torchtune.Weights(tape, sh) if own_order else reference.Weights(tape, sh)
    if job.pruning is not None and not job.pruning.removed:  # after prune.remove: dense again
        prune_replay.install(tape, sh, w, job.pruning, model)
    teacher = None
    if job.distill is not None:  # a frozen teacher beside the student: calc.compress.distill
        teacher = distill.setup(tape, sh, job, device)
    if path is ForwardPath.LITGPT and job.lora is not None:  # finetune/lora.py's adapters
        assert isinstance(w, litgpt.Weights)
        trainable: tuple | None = litgpt_lora.adapt(
            tape, sh, w, job.lora, job.micro_batch == 1, job.quant
        )
    else:
        trainable = _compress(tape, sh, w, model, job)  # LoRA / QLoRA: calc.compress.lora
    ids = tape.existing(sh.b * sh.s, INDEX_ITEMSIZE, "input_ids", "input")
    tape.existing(sh.b * sh.s, INDEX_ITEMSIZE, "targets", "input")  # HF: labels
    if job.offload_activations:  # the recipe's context, made once (calc.replay.offload)
        tape.offload = Offload()
    regime = None
    if path is ForwardPath.LITGPT:
        regime = litgpt.Regime.of_job(job, model)
    converted = regime is not None and regime.converted
    cos, sin = _rope_buffers(tape, sh, model, path, dp, converted)
    params, shapes = trainable if trainable else (w.parameters(), w.shapes(sh))
    opt_params = params if dp is None else data_parallel.optimizer_params(params, dp)
    if dp is not None and dp.optimizer_params is not None:
        shapes = [shapes[i] for i in dp.optimizer_params]
    if dp is not None:
        opt_params = data_parallel.prepare(tape, dp, params, opt_params, shapes)
    fsdp = None
    if dp is not None and dp.fsdp:
        fsdp = _shard(tape, sh, w, job, dp, path, (params, shapes), bool(trainable))
        opt_params = fsdp.optimizer_params(tape, params)
    sliding = sh.n_layers if model.sliding_window is not None else 0
    return StepSetup(tape, sh, w, path, sliding, cos, sin, teacher, opt_params, shapes, fsdp, ids,
                     regime=regime)  # fmt: skip


def _shard(
    tape: Tape, sh: reference.Shape, w: reference.Weights, job: Training, dp: ReplayPlan,
    path: ForwardPath, trained: tuple[list, list], adapters: bool,
) -> Fsdp | Fsdp1:  # fmt: skip
    """The sharding hooks installed: LitGPT's FSDPStrategy (FSDP1, `calc.parallel.fsdp1`) or
    FSDP2 (`calc.parallel.fsdp`; under LoRA the frozen base is sharded and gathered too,
    torchtune's QLoRA as each NF4Tensor's inner tensors)."""
    params, shapes = trained
    if dp.fsdp_version == 1:
        one = Fsdp1(dp.shard_world, dp.fsdp_rank)
        one.install(tape, params, shapes)
        return one
    fsdp = Fsdp(dp.shard_world, dp.reshard_after_forward, offload=dp.offload,
                mixed=dp.param_itemsize > 0, reduce_itemsize=dp.reduce_itemsize,
                replicated=dp.replicated, own_units=path is ForwardPath.TORCHTITAN)  # fmt: skip
    if not adapters:
        fsdp.install(tape, params, shapes)
        return fsdp
    base, base_shapes = w.parameters(), w.shapes(sh)
    unpadded: frozenset[int] = frozenset()
    if job.quant is not None:
        base, base_shapes, unpadded = nf4_torchao.fsdp_inputs(tape, base, base_shapes)
    fsdp.install(tape, [*base, *params], [*base_shapes, *shapes], unpadded)
    return fsdp


def _rope_buffers(
    tape: Tape,
    sh: reference.Shape,
    model: ModelSpec,
    path: ForwardPath,
    dp: ReplayPlan | None,
    converted: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """The RoPE tables the forward reads, as ``(cos, sin)``: the reference model's fp32 (under
    FSDP2's policy) or model-dtype [s, d] tables; torchtune's one fp32 cache (``cos``, with its
    ``theta`` and the recipe's ``ignore_labels_cache``); torchtitan's complex64 ``freqs_cis``
    (``cos``); litgpt's ``cos`` and ``sin`` (``converted``: left at the block size in the
    model's dtype, `calc.models.litgpt.buffers`); none for Hugging Face models, which compute cos/sin in each forward from their
    fp32 ``inv_freq`` and ``original_inv_freq`` [d/2] buffers (llama-style), and for GPT-2."""
    if path is ForwardPath.TORCHTUNE:
        cache = torchtune.buffers(tape, sh, model.max_positions)
        tape.existing(sh.b, INDEX_ITEMSIZE, "ignore_labels_cache", "input")
        return cache, None
    if path is ForwardPath.TORCHTITAN:
        return torchtitan.buffers(tape, sh), None
    if path is ForwardPath.LITGPT:
        cast = dp is not None and dp.fsdp  # FSDP1's lazy init: buffers to buffer_dtype
        return litgpt.buffers(tape, sh, model.max_positions, converted, arch_of(model), cast)
    if path is ForwardPath.HF:
        tape.existing(divide(sh.d, 2), 4, "rope_inv_freq", "buffer")
        tape.existing(divide(sh.d, 2), 4, "rope_original_inv_freq", "buffer")
    if path is not ForwardPath.REFERENCE or model.model_type == "gpt2":
        return None, None
    buf = 4 if dp is not None and dp.param_itemsize else sh.weight_itemsize  # fp32 under MP
    cos = tape.existing(sh.s * sh.d, buf, "rope_cos", "buffer")
    return cos, tape.existing(sh.s * sh.d, buf, "rope_sin", "buffer")


def _head(setup: StepSetup, job: Training) -> Head:
    """The job's head; under FSDP2 with a loss the loop computes, the root's post-forward and
    pre-backward run where the model returns its logits (`calc.models.head.finish`), not around
    the loss."""
    head = Head.of(job)
    if setup.fsdp is None or head.in_model:
        return head
    return Head.of(job, setup.fsdp)


def forward(setup: StepSetup, job: Training) -> Tensor:
    """One micro-batch's forward, to the loss, on the path the model takes."""
    tape, sh, w = setup.tape, setup.sh, setup.w
    use_cache = job.recompute == "none"
    head, held = _head(setup, job), setup.held
    if setup.path is ForwardPath.HF_GPT2:  # enters and leaves autocast itself
        return hf_gpt2.forward(tape, sh, w, use_cache=use_cache, head=head, held=held)
    if setup.path is ForwardPath.HF:  # hf.forward enters and leaves autocast itself
        loss = hf.forward(tape, sh, w, use_cache=use_cache, sliding_layers=setup.sliding_layers,
                          head=head, held=held)  # fmt: skip
        if setup.fsdp is not None and head.root is None:
            setup.fsdp.end_forward(tape)
        return loss
    if setup.path is ForwardPath.LITGPT:  # Fabric's bf16-true or 32-true: no autocast
        assert setup.cos is not None and setup.sin is not None
        assert isinstance(setup.w, litgpt.Weights)
        assert setup.regime is not None
        if isinstance(setup.fsdp, Fsdp1):  # the root's pre-forward, as the model is called
            setup.fsdp.start_forward(tape)
        if job.lora is not None:
            return litgpt_lora.loss_step(tape, sh, setup.w, setup.cos, setup.sin, setup.ids,
                                         held, setup.regime)  # fmt: skip
        return litgpt.loss_step(tape, sh, setup.w, setup.cos, setup.sin, setup.ids, held,
                                setup.regime, root=setup.fsdp)  # fmt: skip
    if setup.path is ForwardPath.TORCHTUNE:  # pure precision: no autocast
        assert setup.cos is not None and isinstance(setup.w, torchtune.Weights)
        one = job.micro_batch == 1
        return torchtune.forward(tape, sh, setup.w, setup.cos, job.loss, job.loss_chunks, one,
                                 setup.ids, root=setup.fsdp)  # fmt: skip
    if sh.autocast_itemsize:
        tape.autocast_enter(sh.autocast_itemsize)
    if setup.path is ForwardPath.TORCHTITAN:  # an fp32 model: FSDP2's policy, autocast or none
        assert setup.cos is not None
        loss = torchtitan.forward(tape, sh, w, setup.cos, setup.ids, root=setup.fsdp)
        tape.autocast_exit()
        return loss
    if setup.teacher is None:
        loss = reference.forward(tape, sh, w, setup.cos, setup.sin, head, held)
    else:
        loss = distill.forward(tape, sh, w, setup.cos, setup.sin, setup.teacher)
    if setup.fsdp is not None:
        setup.fsdp.end_forward(tape)
    tape.autocast_exit()
    return loss


REPLAYED_MICRO_BATCHES = 2
"""Micro-batches of a step the replay plays out. From the second on, every micro-batch finds
the same tensors alive (the accumulated gradients, the optimizer states, the loss scaler) and
allocates and frees the same ones, so its events repeat the second's exactly: the peak over any
``grad_accum >= 2`` is the peak over two (tests/calc/step/test_training.py replays up to six
in full and compares). Bounding the replay keeps time and memory constant in ``grad_accum``."""


NO_SYNC_MICRO_BATCHES = 3
"""The same for LitGPT, whose FSDPStrategy runs all but the last micro-batch under ``no_sync``
(`calc.parallel.fsdp1`): the first finds no unsharded gradient, the middle ones add to them
(all of them repeat the second's events), the last reduces them; three cover the peak."""


def replayed_micro_batches(job: Training) -> int:
    """How many of ``job``'s micro-batches a step's replay plays out (`REPLAYED_MICRO_BATCHES`,
    `NO_SYNC_MICRO_BATCHES` for LitGPT's loop, on one device too)."""
    cap = NO_SYNC_MICRO_BATCHES if job.implementation == "litgpt" else REPLAYED_MICRO_BATCHES
    return min(job.grad_accum, cap)


def run_steps(
    job: Training,
    setup: StepSetup,
    device: str,
    dp: ReplayPlan | None,
    size_values: SizeValues,
) -> list[Event]:
    """Steps 1 and 2: ``grad_accum`` forward/backward pairs (at most `REPLAYED_MICRO_BATCHES` of
    them played out: the rest repeat), then the optimizer step
    (`calc.step.optimizer.optimizer_step`; none on the GPU when ``dp`` offloads it)."""
    tape, fsdp = setup.tape, setup.fsdp
    stepper = OptimizerTail(
        job, device, setup.opt_params, setup.shapes, size_values,
        offloaded=dp is not None and dp.offload != "none",
    )  # fmt: skip
    scaler: list = []
    if job.optimizer_in_backward:  # each gradient steps its parameter as soon as it is ready
        tape.grad_hook = stepper.in_backward
    for step in (1, 2):
        for mb in range(replayed_micro_batches(job)):
            tape.phase = f"step{step}/forward"
            tape.segment = "embed"
            loss = forward(setup, job)
            if job.precision == "amp-fp16":
                loss, scaler = _scale_loss(tape, loss, scaler)
            if job.zero_grad == "before_backward" and mb == 0:
                tape.zero_grad()
            tape.phase = f"step{step}/backward"
            tape.segment = "head"
            if isinstance(fsdp, Fsdp1):  # no_sync but on the step's last micro-batch
                fsdp.sync = mb == replayed_micro_batches(job) - 1
            if fsdp is not None and Head.of(job).in_model:  # else at the logits (_head)
                fsdp.start_backward(tape)
            # FSDP's final callback (and FSDP1's root post-backward) run inside the engine
            tape.backward(loss, final=fsdp.end_backward if fsdp is not None else None)
            tape.drop(loss)
        tape.phase = f"step{step}/optimizer"
        tape.segment = "optimizer"
        if fsdp is not None:
            fsdp.before_optimizer(tape)
        stepper.step(tape, first_step=step == 1)
    return tape.events


def _scale_loss(tape: Tape, loss: Tensor, scaler: list) -> tuple[Tensor, list]:
    """``GradScaler.scale(loss)``: its first call creates ``_scale`` (fp32) and
    ``_growth_tracker`` (int32), 0-d tensors kept for the run (``torch/amp/grad_scaler.py``,
    ``_lazy_init_scale_growth_tracker``); then ``loss * _scale``."""
    if not scaler:
        saved, tape.segment = tape.segment, "base"
        scaler = [tape.new(1, 4, "grad_scaler.scale", "state"), tape.new(1, 4, "growth", "state")]
        tape.segment = saved
    scaled = ops.mul(tape, loss, scaler[0], "scaled_loss")
    tape.drop(loss)
    return scaled, scaler


def _compress(
    tape: Tape, sh: reference.Shape, w: reference.Weights, model: ModelSpec, job: Training
) -> tuple | None:
    """LoRA/QLoRA (`calc.compress.lora.compress_weights`): the trainable adapters and their shapes."""
    if job.lora is None:
        return None
    amp = job.precision.startswith("amp-")
    if amp and job.quant is not None:
        raise NotImplementedError(
            f"precision={job.precision!r} with a quantized base is not modelled yet "
            "(use bf16 or fp32)"
        )
    if job.pruning is not None or job.distill is not None:
        raise NotImplementedError("LoRA together with pruning or distillation")
    if job.lora.adapter_dtype is not None and (amp or job.precision == "bf16-master"):
        raise NotImplementedError(
            f"adapter_dtype with precision={job.precision!r} is not modelled (use bf16 or fp32)"
        )
    compute = "fp32" if job.precision == "fp32" or amp else "bf16"
    tt = job.implementation == "torchtune"  # its adapters follow its registration order
    order = torchtune.LORA_ORDER if tt else LINEAR_KEYS
    library = library_of(job)  # torchtune's QLoRA: torchao's NF4Tensor
    return compress_weights(tape, w, sh, job.lora, job.quant, compute, order, library)


def _recording(hook, order: list):
    """Wrap a grad hook to append each leaf the first time its gradient is ready."""
    seen: set[int] = set()

    def record(tape: Tape, leaf: Tensor) -> None:
        if id(leaf.storage) not in seen:
            seen.add(id(leaf.storage))
            order.append(leaf)
        if hook is not None:
            hook(tape, leaf)

    return record
