"""What the user runs: a training step or an inference pass, each a frozen, validated config.

Every choice that changes memory is a field; invalid values raise ``ValueError`` naming the
field, the value and what is allowed. Verbose names are the user's; the cost model reads them
through the same fields (no second spelling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from calc.config.checks import check_bool, check_choice, check_fraction, check_size
from calc.config.compression import KVQuant, LoRA, Quant, check_kv_quant, check_lora_quant
from calc.config.distill import Distill
from calc.config.pruning import Pruning

Precision = Literal["fp32", "amp-bf16", "amp-fp16", "bf16", "bf16-master"]
Optimizer = Literal[
    "sgd", "sgd-momentum", "adam", "adamw", "adam8bit", "adam32bit", "adafactor", "lion"
]
OptimizerImpl = Literal["foreach", "fused", "for-loop"]
Recompute = Literal["none", "selective", "full", "op"]
Attention = Literal["sdpa", "eager", "flash", "efficient", "math"]
Implementation = Literal["hf", "reference", "derived", "torchtune", "torchtitan", "litgpt"]
InferenceImplementation = Literal["hf", "reference", "derived"]
ZeroGrad = Literal["after_step", "before_backward"]
Loop = Literal["drop-output", "hold-output", "del-logits"]
Loss = Literal["cross-entropy", "chunked-ce", "sum"]
InferencePrecision = Literal["fp32", "bf16", "fp16"]
CacheImpl = Literal["dynamic", "static"]
Padding = Literal["none", "left"]
Compile = Literal["none", "default", "regional"]
Device = Literal["cuda", "cpu"]

PRECISIONS: tuple[str, ...] = get_args(Precision)
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
OPTIMIZER_IMPLS: tuple[str, ...] = get_args(OptimizerImpl)
RECOMPUTES: tuple[str, ...] = get_args(Recompute)
HAND_RECOMPUTES: tuple[str, ...] = ("none", "selective", "full")
"""The recomputations the hand graphs replay (``op`` is recorded from transformers' code only:
the planner's grid and the app's prefetch leave it out, as they leave out ``compile``)."""
ATTENTIONS: tuple[str, ...] = get_args(Attention)
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)
INFERENCE_IMPLEMENTATIONS: tuple[str, ...] = get_args(InferenceImplementation)
ZERO_GRADS: tuple[str, ...] = get_args(ZeroGrad)
LOOPS: tuple[str, ...] = get_args(Loop)
LOSSES: tuple[str, ...] = get_args(Loss)
MAX_LOSS_CHUNKS = 1024
"""Most chunks ``loss="chunked-ce"`` takes."""
INFERENCE_PRECISIONS: tuple[str, ...] = get_args(InferencePrecision)
DEVICES: tuple[str, ...] = get_args(Device)
CACHE_IMPLS: tuple[str, ...] = get_args(CacheImpl)
PADDINGS: tuple[str, ...] = get_args(Padding)
COMPILES: tuple[str, ...] = get_args(Compile)


@dataclass(frozen=True, kw_only=True, slots=True)
class Training:
    """One optimizer step of training, per GPU."""

    micro_batch: int
    """Sequences per micro-batch on this GPU."""
    seq_len: int
    """Tokens per sequence."""
    precision: Precision = "amp-bf16"
    """``fp32``; ``amp-bf16``/``amp-fp16`` (torch.autocast over fp32 weights, grads and states;
    GradScaler for fp16); ``bf16`` (weights, grads and states in bf16); ``bf16-master`` (bf16
    weights and grads, fp32 master weights and fp32 optimizer states)."""
    optimizer: Optimizer | None = "adamw"
    """Optimizer; its states and step-time temporaries are terms of the peak. ``None``:
    forward and backward alone (no optimizer, no states, no step; ``zero_grad`` still runs).
    ``adam8bit`` and ``adam32bit`` are bitsandbytes' ``Adam8bit``/``AdamW8bit`` (blockwise
    uint8 states) and ``Adam32bit``/``AdamW32bit`` (fp32 states), each updated by one CUDA
    kernel in place."""
    optimizer_impl: OptimizerImpl = "foreach"
    """PyTorch's multi-tensor (``foreach``, the CUDA default), ``fused`` or per-tensor loop."""
    recompute: Recompute = "none"
    """Activation recomputation: none, ``selective`` (attention core), ``full`` (every layer) or
    ``op``: torchtitan's op-level selective checkpointing (``selective_ac_option="op"``) on
    every decoder layer: the outputs of SDPA and of every other ``mm`` kept, the rest
    recomputed (recorded from transformers' code: implementation 'hf' or 'derived'; on
    torchtitan's own model: implementation 'torchtitan')."""
    recompute_every: int = 1
    """With ``recompute="full"``: checkpoint every n-th decoder layer only (layers 0, n, 2n,
    ...), the others keep their activations (transformers'
    ``activation_checkpointing_enable(every_n_layers=n)``; torchtune's and torchtitan's
    layer-frequency option is the same trade). 1: every layer."""
    attention: Attention = "sdpa"
    """``sdpa`` (the kernel CUDA picks), a forced SDPA kernel, or ``eager`` softmax attention."""
    implementation: Implementation = "hf"
    """Which modeling code runs: Hugging Face transformers (``hf``), verify's ``reference``, or
    ``derived``: transformers' code with the replay recorded from it (`calc.derive`) instead of
    the hand-written graph (the default for model types that have none); ``torchtune``
    (training): torchtune's Llama (fp32 RMSNorm and RoPE, logits upcast or chunked) and its
    recipe's loss step, with ``loop="del-logits"`` (`calc.models.torchtune`); ``torchtitan``
    (training): torchtitan 0.2.2's Llama 3 (``nn.RMSNorm``, fp32 complex RoPE, SDPA with
    ``enable_gqa``) and its trainer's loss step (the logits upcast, ``reduction="sum"`` over
    the count of valid tokens), with ``loop="del-logits"`` (`calc.models.torchtitan`);
    ``litgpt`` (training): LitGPT 0.5.12's Llama (fused qkv, fp32 RMSNorm and RoPE tables) and
    its full fine-tuning loop (the logits and loss held until the next iteration, the loss in
    128-row chunks), with ``loop="hold-output"`` and ``loss="chunked-ce"``
    (`calc.models.litgpt`); with ``lora``, its LoRA loop (the head in 128-token chunks,
    `calc.compress.litgpt_lora`); with ``quant`` too, its QLoRA (``--quantize bnb.nf4``: every
    linear in NF4, the head too, ``StableEmbedding`` in place of ``wte``, bitsandbytes'
    ``PagedAdamW``: ``optimizer="adam32bit", paged_optimizer=True``)."""
    grad_accum: int = 1
    """Micro-batches accumulated into one optimizer step."""
    weight_decay: float = 0.0
    """Weight decay (coupled Adam/SGD decay allocates a gradient-sized temporary)."""
    dropout: float | None = None
    """Dropout probability for every dropout site; None keeps the model config's values."""
    zero_grad: ZeroGrad = "after_step"
    """Where ``zero_grad(set_to_none=True)`` runs: after ``step()`` (grads absent during the
    forward) or just before ``backward()`` (grads of the last step alive through the forward)."""
    lora: LoRA | None = None
    """Low-rank adapters on a frozen base (``calc.LoRA``); ``None`` trains every weight."""
    quant: Quant | None = None
    """Weight-only quantization of the frozen base (``calc.Quant``); needs ``lora`` (QLoRA)."""
    pruning: Pruning | None = None
    """``torch.nn.utils.prune`` reparameterisation of the layers' linears (``calc.Pruning``);
    for structured pruning use ``calc.pruned_spec`` on the model instead."""
    distill: Distill | None = None
    """Knowledge distillation from a frozen teacher (``calc.Distill``); ``None``: plain CE."""
    loop: Loop = "drop-output"
    """Who holds the model's output: ``drop-output`` (``loss = model(...).loss``, Hugging Face
    Trainer: the output object dies before backward); ``hold-output`` (``out = model(...);
    out.loss.backward()``: the output, logits and cache included, lives until the next
    forward returns, through backward and the optimizer step); ``del-logits`` (torchtitan:
    the model returns logits, the loop computes the loss and ``del``s them before backward)."""
    loss: Loss = "cross-entropy"
    """``cross-entropy`` (the model's own: Hugging Face's ``ForCausalLMLoss``, the reference
    model's ``F.cross_entropy``, on the logits as they are; ``implementation="torchtitan"``:
    its trainer's, on the logits upcast to fp32);
    ``chunked-ce`` (torchtune's ``CEWithChunkedOutputLoss`` style: the head's logits in
    ``loss_chunks`` chunks over the sequence, each upcast and reduced in turn); ``sum`` (a
    plain ``logits.sum()``, as benchmark scripts do)."""
    loss_chunks: int = 8
    """Chunks of ``loss="chunked-ce"`` (torchtune's ``num_output_chunks``, default 8)."""
    optimizer_in_backward: bool = False
    """torchtune's ``optimizer_in_bwd``: one optimizer per parameter, stepped by a
    post-accumulate-grad hook as soon as its gradient is ready, then ``zero_grad`` (the
    gradients never all exist together)."""
    paged_optimizer: bool = False
    """bitsandbytes' paged optimizers (``PagedAdamW8bit``, ``PagedAdamW32bit``; Hugging Face
    ``optim="paged_adamw_8bit"``/``"paged_adamw_32bit"``): the states of every parameter of at
    least 100,000 elements live in CUDA managed memory (``cudaMallocManaged``), outside
    PyTorch's allocator, so they are not in the peak; the estimate names their bytes. Needs
    ``optimizer`` ``adam8bit`` or ``adam32bit``."""
    offload_activations: bool = False
    """Saved activations held in pinned host memory; needs ``recompute="full"``, as torchtune's
    recipes do. ``implementation="torchtune"``: its ``enable_activation_offloading``
    (``OffloadActivations``, streams on): what the forward saves (each checkpointed layer's
    input, ...), 1 KiB or more and not a parameter, goes to the host and comes back when its
    backward node runs (`calc.replay.offload`); one GPU and its FSDP2 recipes. ``hf`` and
    ``derived``: transformers' ``activation_checkpointing_enable(offload=True)`` (the layers'
    inputs, ``save_on_cpu``), recorded from its code (`calc.derive.offload`)."""
    compile: Compile = "none"
    """``none`` (eager); ``default``: the whole model wrapped by ``torch.compile(model)`` in its
    default mode (Inductor; AOTAutograd's partitioner chooses what the forward saves, the
    generated code allocates its own buffers); ``regional``: each decoder layer compiled on its
    own (``layer.compile()``: torchtune's ``compile_model``, torchtitan's per-block compile),
    the embedding, head and loss eager. Recorded from Inductor's own code at the job's sizes,
    one GPU (`calc.derive.inductor`, docs/compile.md)."""

    def __post_init__(self) -> None:
        check_size("micro_batch", self.micro_batch, 1, 1 << 20)
        check_choice("compile", self.compile, COMPILES)
        check_size("seq_len", self.seq_len, 1, 1 << 24)
        check_choice("precision", self.precision, PRECISIONS)
        if self.optimizer is not None:
            check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("loop", self.loop, LOOPS)
        check_choice("loss", self.loss, LOSSES)
        check_size("loss_chunks", self.loss_chunks, 1, MAX_LOSS_CHUNKS)
        check_bool("optimizer_in_backward", self.optimizer_in_backward)
        if self.optimizer_in_backward and self.optimizer is None:
            raise ValueError("optimizer_in_backward=True needs an optimizer (not None)")
        check_choice("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        check_choice("recompute", self.recompute, RECOMPUTES)
        check_size("recompute_every", self.recompute_every, 1, 1 << 16)
        if self.recompute_every != 1 and self.recompute != "full":
            raise ValueError(
                f"recompute_every={self.recompute_every} needs recompute='full' (it says which "
                f"layers are checkpointed), got recompute={self.recompute!r}"
            )
        check_choice("attention", self.attention, ATTENTIONS)
        check_choice("implementation", self.implementation, IMPLEMENTATIONS)
        check_size("grad_accum", self.grad_accum, 1, 1 << 16)
        check_choice("zero_grad", self.zero_grad, ZERO_GRADS)
        wd = self.weight_decay
        if isinstance(wd, bool) or not isinstance(wd, int | float) or not 0 <= wd < math.inf:
            raise ValueError(f"weight_decay={wd!r} must be a finite number >= 0")
        if self.dropout is not None:
            check_fraction("dropout", self.dropout)
        if self.optimizer is None and self.precision in ("amp-fp16", "bf16-master"):
            raise ValueError(
                f"optimizer=None with precision={self.precision!r}: the GradScaler and the fp32 "
                "master weights belong to an optimizer step; use 'fp32', 'bf16' or 'amp-bf16'"
            )
        if (
            self.optimizer is not None
            and self.optimizer_impl == "fused"
            and self.optimizer
            not in (
                "adam",
                "adamw",
                "sgd",
                "sgd-momentum",
            )
        ):
            raise ValueError(
                f"optimizer_impl='fused' is not available for optimizer={self.optimizer!r}: "
                "PyTorch fuses adam, adamw, sgd and sgd-momentum"
            )
        check_bool("offload_activations", self.offload_activations)
        if self.offload_activations and self.recompute != "full":
            raise ValueError(
                f"offload_activations=True needs recompute='full' (torchtune's recipes refuse "
                f"offloading without activation checkpointing), got recompute={self.recompute!r}"
            )
        check_bool("paged_optimizer", self.paged_optimizer)
        if self.paged_optimizer and self.optimizer not in ("adam8bit", "adam32bit"):
            raise ValueError(
                f"paged_optimizer=True with optimizer={self.optimizer!r}: bitsandbytes pages "
                "the states of 'adam8bit' and 'adam32bit'"
            )
        check_lora_quant(self.lora, self.quant)
        if self.pruning is not None and not isinstance(self.pruning, Pruning):
            raise ValueError(f"pruning={self.pruning!r} must be a calc.Pruning or None")
        if self.distill is not None and not isinstance(self.distill, Distill):
            raise ValueError(f"distill={self.distill!r} must be a calc.Distill or None")


MAX_TOP_K = 1 << 20
"""Largest ``top_k`` `Sampling` takes."""
MAX_BEAMS = 1024
"""Most beams ``Inference.num_beams`` takes."""
MAX_RETURN_SEQUENCES = 1024
"""Most sequences per prompt ``Inference.num_return_sequences`` takes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sampling:
    """``generate(do_sample=True, ...)``: the logits processors that run on each step's fp32
    scores before ``softmax`` and ``multinomial`` (transformers ``generation/utils.py``
    ``_sample``, ``generation/logits_process.py``). Defaults are transformers' own
    (``GenerationConfig._get_default_generation_params``): temperature 1, top-k 50, top-p 1,
    no repetition penalty. Each processor that runs allocates its own scores-sized tensors
    (top-p sorts the whole vocabulary: values and int64 indices)."""

    temperature: float = 1.0
    """Scores divided by it (``TemperatureLogitsWarper``; 1: not applied); > 0."""
    top_k: int = 50
    """Keep the ``top_k`` highest scores (``TopKLogitsWarper``; 0: not applied)."""
    top_p: float = 1.0
    """Keep the smallest set whose probability reaches ``top_p`` (``TopPLogitsWarper``; 1: not
    applied); in (0, 1]."""
    repetition_penalty: float = 1.0
    """Penalise tokens already in the sequence (``RepetitionPenaltyLogitsProcessor``; 1: not
    applied); > 0."""

    def __post_init__(self) -> None:
        for name in ("temperature", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name}={value!r} must be a number > 0")
        check_size("top_k", self.top_k, 0, MAX_TOP_K)
        top_p = self.top_p
        if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p!r} must be a number in (0, 1]")

    def generate_kwargs(self) -> dict[str, float | int | bool]:
        """The keyword arguments of ``model.generate`` that select this sampling."""
        return {
            "do_sample": True, "temperature": float(self.temperature), "top_k": self.top_k,
            "top_p": float(self.top_p), "repetition_penalty": float(self.repetition_penalty),
        }  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Inference:
    """A prefill of ``prompt`` tokens into a KV cache of ``context`` tokens, per GPU; with
    ``new_tokens`` > 0, Hugging Face ``generate`` (greedy) of that many tokens after the prompt,
    its peak over the prefill and every decode step."""

    batch: int
    """Sequences served together."""
    context: int = 0
    """Tokens the KV cache holds per sequence (prompt plus generated); 0 (the default): ``prompt
    + new_tokens``. With ``new_tokens`` > 0 it is that sum (given, it must equal it)."""
    prompt: int | None = None
    """Tokens in the prefill forward (default: ``context``); needed with ``new_tokens`` > 0."""
    precision: InferencePrecision = "bf16"
    """Weights, activations and KV cache dtype."""
    attention: Attention = "sdpa"
    """Attention kernel for the prefill."""
    implementation: InferenceImplementation = "hf"
    """Which modeling code runs (``torchtune`` is a training implementation)."""
    quant: Quant | None = None
    """Weight-only quantization of the weights (``calc.Quant``); ``None`` keeps ``precision``."""
    kv_quant: KVQuant | None = None
    """KV-cache quantization: ``int8`` (one scale per token and head) or ``fp8`` (e4m3, one
    scale per layer for K and for V); ``None`` stores the cache in ``precision``."""
    new_tokens: int = 0
    """Tokens ``generate`` makes after the prompt (greedy, ``max_new_tokens``); 0: the prefill
    alone (into a static cache of ``context`` tokens)."""
    cache: CacheImpl | None = None
    """``generate``'s KV cache: ``dynamic`` (``DynamicCache``, grown by ``torch.cat`` each step:
    the default of ``generate``) or ``static`` (``cache_implementation="static"``, allocated for
    ``prompt + new_tokens`` tokens); ``None``: ``dynamic`` when generating, the prefill alone's
    static cache otherwise."""
    sampling: Sampling | None = None
    """``generate``'s decoding: ``None`` greedy (``do_sample=False``, the default of a model
    without a ``generation_config.json``); a `Sampling` samples (``do_sample=True``). Needs
    ``new_tokens`` >= 1."""
    num_beams: int = 1
    """``generate(num_beams=k)``: beam search (transformers ``generation/utils.py``,
    ``_beam_search``) over ``batch x k`` rows: the prompt's rows, the KV cache and the step's
    logits are ``k`` times greedy's, the cache is reordered each step (``reorder_cache``: a new
    copy of each layer's keys and values, ``index_select``) and the search keeps static-shaped
    sequence, score and index tensors of ``2k`` candidates; with ``sampling``, beam sampling.
    1: no beam search. Needs ``new_tokens`` >= 1."""
    num_return_sequences: int = 1
    """``generate(num_return_sequences=r)``: ``r`` sequences returned per prompt. Sampling
    expands the prompt to ``batch x r`` rows before the prefill (transformers
    ``generation/utils.py``, ``_expand_inputs_for_generation`` with ``max(num_beams, r)``), so
    the cache and each step's scores are ``r`` times a single sequence's; beam search keeps its
    ``batch x num_beams`` rows and returns the best ``r`` (at most ``num_beams``). Greedy
    decoding refuses more than 1, as transformers does (``GenerationConfig.validate``)."""
    output_scores: bool = False
    """``generate(return_dict_in_generate=True, output_scores=True)``: every decode step's
    processed scores (fp32 ``[rows, vocab]``) kept in the returned tuple until ``generate``
    returns, so the decode grows by one such tensor per new token (transformers
    ``generation/utils.py``, ``_sample``: ``scores += (next_token_scores,)``). Needs
    ``new_tokens`` >= 1."""
    output_logits: bool = False
    """``generate(return_dict_in_generate=True, output_logits=True)``: every step's raw fp32
    logits kept the same way (``raw_logits += (next_token_logits,)``); greedy without
    processors keeps one tensor for both flags. Needs ``new_tokens`` >= 1."""
    padding: Padding = "none"
    """The prompts' attention mask: ``none``, prompts of one length (no mask, or the
    tokenizer's mask of ones, which ``generate`` drops); ``left``, prompts of different
    lengths left-padded to ``prompt`` tokens, their mask passed (``attention_mask=``): the
    model builds a 4-D mask each forward and ``generate`` grows the 2-D one each step. How
    many tokens are padded does not change the memory."""

    def __post_init__(self) -> None:
        check_size("batch", self.batch, 1, 1 << 20)
        check_size("new_tokens", self.new_tokens, 0, 1 << 24)
        if self.new_tokens > 0:
            self._generate_context()
        elif self.context == 0 and self.prompt is None:
            raise ValueError("context=0 needs prompt: give context (or prompt, and new_tokens)")
        elif self.context == 0:
            object.__setattr__(self, "context", self.prompt)
        check_size("context", self.context, 1, 1 << 24)
        if self.prompt is not None:
            check_size("prompt", self.prompt, 1, self.context)
        check_choice("precision", self.precision, INFERENCE_PRECISIONS)
        check_choice("attention", self.attention, ATTENTIONS)
        check_choice("implementation", self.implementation, INFERENCE_IMPLEMENTATIONS)
        if self.cache is not None:
            check_choice("cache", self.cache, CACHE_IMPLS)
            if self.new_tokens == 0 and self.cache == "dynamic":
                raise ValueError(
                    "cache='dynamic' needs new_tokens >= 1: the prefill alone (new_tokens=0) "
                    "writes a static cache of context tokens"
                )
        if self.quant is not None and not isinstance(self.quant, Quant):
            raise ValueError(f"quant={self.quant!r} must be a calc.Quant or None")
        check_kv_quant(self.kv_quant)
        check_choice("padding", self.padding, PADDINGS)
        if self.sampling is not None:
            if not isinstance(self.sampling, Sampling):
                raise ValueError(f"sampling={self.sampling!r} must be a calc.Sampling or None")
            if self.new_tokens == 0:
                raise ValueError("sampling needs new_tokens >= 1 (it decodes generated tokens)")
        check_size("num_beams", self.num_beams, 1, MAX_BEAMS)
        if self.num_beams > 1 and self.new_tokens == 0:
            raise ValueError(
                f"num_beams={self.num_beams} needs new_tokens >= 1 (beam search decodes "
                "generated tokens)"
            )
        self._check_return_sequences()
        self._check_kept_outputs()

    def _check_kept_outputs(self) -> None:
        """``output_scores`` and ``output_logits``: bools, and only for ``generate``."""
        for name in ("output_scores", "output_logits"):
            check_bool(name, getattr(self, name))
            if getattr(self, name) and self.new_tokens == 0:
                raise ValueError(f"{name}=True needs new_tokens >= 1 (generate's decode steps)")

    def _check_return_sequences(self) -> None:
        """``num_return_sequences`` in range, and as transformers' ``GenerationConfig.validate``
        allows it (configuration_utils.py, "check `num_return_sequences`"): more than 1 needs
        sampling or beam search, and beam search returns at most ``num_beams``."""
        r = self.num_return_sequences
        check_size("num_return_sequences", r, 1, MAX_RETURN_SEQUENCES)
        if r == 1:
            return
        if self.num_beams == 1 and self.sampling is None:
            raise ValueError(
                f"num_return_sequences={r} needs sampling or num_beams >= {r}: greedy "
                "decoding returns one sequence per prompt (transformers refuses more)"
            )
        if self.num_beams > 1 and r > self.num_beams:
            raise ValueError(
                f"num_return_sequences={r} must be at most num_beams={self.num_beams} "
                "(beam search returns its best beams)"
            )

    def _generate_context(self) -> None:
        """``context`` of a ``generate`` job: ``prompt + new_tokens`` (``prompt`` required)."""
        if self.prompt is None:
            raise ValueError(
                f"new_tokens={self.new_tokens} needs prompt (the tokens before generation)"
            )
        check_size("prompt", self.prompt, 1, 1 << 24)
        total = self.prompt + self.new_tokens
        if self.context not in (0, total):
            raise ValueError(
                f"context={self.context!r} must be prompt + new_tokens = {total} (or left 0) "
                "when new_tokens > 0"
            )
        object.__setattr__(self, "context", total)

    def decoding_kwargs(self) -> dict[str, float | int | bool]:
        """The keyword arguments of ``model.generate`` that select the decoding: greedy
        (``do_sample=False``) or `Sampling.generate_kwargs`, ``num_beams`` and
        ``num_return_sequences`` when above 1, and the kept outputs (``output_scores``,
        ``output_logits``) when asked."""
        kw = self.sampling.generate_kwargs() if self.sampling is not None else {"do_sample": False}
        if self.num_beams > 1:
            kw["num_beams"] = self.num_beams
        if self.num_return_sequences > 1:
            kw["num_return_sequences"] = self.num_return_sequences
        if self.output_scores or self.output_logits:
            kw["return_dict_in_generate"] = True
            kw["output_scores"] = self.output_scores
            kw["output_logits"] = self.output_logits
        return kw

    @property
    def prompt_len(self) -> int:
        return self.context if self.prompt is None else self.prompt

    @property
    def cache_impl(self) -> CacheImpl:
        """The cache that runs: ``cache``, or its default (``dynamic`` when generating)."""
        if self.cache is not None:
            return self.cache
        return "dynamic" if self.new_tokens > 0 else "static"
