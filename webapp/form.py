"""Every input of the web calculator in one table: widget key, URL query parameter, allowed values.

Each ``FormField`` is one flat option, one widget and one URL parameter. A scalar job field
(a field of ``calc.Training`` or ``calc.Inference``) is one ``FormField`` of the same name; a job
field holding an object (``lora``, ``quant``, ``pruning``, ``distill``, ``kv_quant``) is several
flat options (``of`` names the field) and one builder in ``OBJECT_BUILDERS`` that makes the
object from them with the CLI's helpers (``calc.cli.compression``, ``calc.cli.prune_distill``);
``PARALLELISM`` holds one option per ``calc.Parallelism`` field (``of="parallel"``,
``build_parallel``). ``tests/webapp/test_form.py`` fails while a job field or a ``Parallelism``
field has no option.

The state of the page is a flat ``dict`` keyed by widget key; ``to_query`` and ``from_query``
turn it into the URL query string and back (every value parsed and validated, never evaluated),
so a result can be shared by link.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import calc
from calc.cli import compression as cli_compression
from calc.cli import prune_distill as cli_prune_distill
from calc.config import jobs
from calc.config.compression import (
    DECODER_LORA_MODULES,
    FP8_SCALINGS,
    KV_QUANTS,
    LORA_MODULES,
    MAX_GROUP,
    MAX_RANK,
    QUANT_METHODS,
    SCALE_DTYPES,
)
from calc.config.distill import MAX_TEMPERATURE, TEACHER_PRECISIONS
from calc.config.parallelism import (
    FSDP_PARAM_DTYPES,
    FSDP_REDUCE_DTYPES,
    MAX_DEGREE,
    OFFLOADS,
    PIPELINE_SCHEDULES,
    ZERO_PARTITIONS,
)
from calc.config.pruning import GPT2_MODULES, LLAMA_MODULES, PRUNING_KINDS, Pruning
from calc.plan import planner as plan
from calc.plan.axes import AXES

Kind = Literal["choice", "int", "float", "optional_int", "optional_float", "bool", "multi"]
TASKS: tuple[str, ...] = ("train", "infer")
TASK_LABELS: dict[str, str] = {"train": "training step", "infer": "inference (prefill, generate)"}
JOB_CLASS: dict[str, type] = {"train": calc.Training, "infer": calc.Inference}
SOURCES: tuple[str, ...] = ("card", "hub", "paste", "upload")
SOURCE_LABELS: dict[str, str] = {
    "card": "model card",
    "hub": "Hugging Face id",
    "paste": "paste config.json",
    "upload": "upload config.json",
}
DEFAULT_CARD = "qwen2.5-32b"
MAX_URL_CONFIG_CHARS = 4000
"""A custom config longer than this (minified JSON) is not put in the shareable link."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FormField:
    """One job field as a widget."""

    task: str
    """``train`` (a ``calc.Training`` field) or ``infer`` (a ``calc.Inference`` field)."""
    name: str
    """The job field; also the URL query parameter while this task is selected."""
    label: str
    """What the widget says."""
    kind: Kind
    """``choice`` (selectbox), ``int``/``float`` (number input), ``optional_*`` (may be empty:
    the job class's default, None, applies), ``bool`` (checkbox), ``multi`` (a tuple of
    ``choices``, in their order; multiselect; comma-separated in the URL)."""
    default: object
    """Value when neither the URL nor the user set one."""
    choices: tuple[str, ...] = ()
    """Allowed values of a ``choice``."""
    low: float = 1
    """Smallest value of a number."""
    high: float = 1 << 20
    """Largest value of a number."""
    section: str = "job"
    """Where the widget goes: ``job``, ``parallelism``, ``compression`` or ``advanced``."""
    help: str = ""
    """Tooltip."""
    of: str = ""
    """What the option is part of: empty, the job field ``name`` itself; a job field holding an
    object (``lora``, ``quant``, ``kv_quant``, ``pruning``, ``distill``), built from its flat
    options by ``OBJECT_BUILDERS``; or ``parallel``, a field of ``calc.Parallelism``."""
    needs: str = ""
    """The option (``name``) that switches this one on: the widget is disabled, and the value
    ignored, while that option is ``none`` or empty."""

    @property
    def target(self) -> str:
        """The job field this option sets (``parallel`` for a ``calc.Parallelism`` field)."""
        return self.of or self.name

    @property
    def key(self) -> str:
        """The widget key: ``<task>.<name>`` (stable across reruns and pages)."""
        return f"{self.task}.{self.name}"


def _default(cls: type, name: str) -> object:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


T, I = calc.Training, calc.Inference  # noqa: E741

TRAINING: tuple[FormField, ...] = (
    FormField(task="train", name="micro_batch", label="micro-batch", kind="int", default=1,
              high=1 << 20, help="sequences per micro-batch on one GPU"),
    FormField(task="train", name="seq_len", label="sequence length", kind="int", default=2048,
              high=1 << 24, help="tokens per sequence"),
    FormField(task="train", name="precision", label="precision", kind="choice",
              default=_default(T, "precision"), choices=jobs.PRECISIONS,
              help="amp-*: autocast over fp32 weights; bf16: everything bf16; "
              "bf16-master: bf16 weights and grads, fp32 master weights and states"),
    FormField(task="train", name="optimizer", label="optimizer", kind="choice",
              default=_default(T, "optimizer"), choices=(*jobs.OPTIMIZERS, "none"),
              help="none: forward and backward alone (no optimizer states, no step)"),
    FormField(task="train", name="recompute", label="recompute", kind="choice",
              default=_default(T, "recompute"), choices=jobs.RECOMPUTES,
              help="activation recomputation: selective = attention core, full = every layer, "
                   "op = torchtitan's per-op policy (SDPA and every other matmul kept)"),
    FormField(task="train", name="recompute_every", label="checkpoint every n-th layer",
              kind="int", default=_default(T, "recompute_every"), high=1 << 16,
              section="advanced", help="with recompute full: layers 0, n, 2n, ... checkpointed "
              "(transformers' every_n_layers); 1 = every layer"),
    FormField(task="train", name="attention", label="attention", kind="choice",
              default=_default(T, "attention"), choices=jobs.ATTENTIONS,
              help="sdpa = the kernel CUDA picks; or force a kernel; eager = softmax written out"),
    FormField(task="train", name="optimizer_impl", label="optimizer implementation",
              kind="choice", default=_default(T, "optimizer_impl"),
              choices=jobs.OPTIMIZER_IMPLS, section="advanced"),
    FormField(task="train", name="implementation", label="modeling code", kind="choice",
              default=_default(T, "implementation"), choices=jobs.IMPLEMENTATIONS,
              section="advanced",
              help="hf = Hugging Face transformers; reference = verify's plain PyTorch; "
              "torchtune / torchtitan = their own Llama and loss step (loop del-logits); "
              "litgpt = LitGPT's Llama and fine-tuning loops, full, LoRA or QLoRA (hold-output, "
              "chunked-ce; QLoRA: nf4, the LM head quantized too, paged adam32bit); full on "
              "several devices: FSDP version 1 with use_orig_params, recompute full"),
    FormField(task="train", name="grad_accum", label="gradient accumulation", kind="int",
              default=_default(T, "grad_accum"), high=1 << 16, section="advanced",
              help="micro-batches per optimizer step"),
    FormField(task="train", name="weight_decay", label="weight decay", kind="float",
              default=_default(T, "weight_decay"), low=0.0, high=10.0, section="advanced"),
    FormField(task="train", name="dropout", label="dropout", kind="optional_float",
              default=_default(T, "dropout"), low=0.0, high=0.99, section="advanced",
              help="dropout probability everywhere; empty = the model config's values"),
    FormField(task="train", name="zero_grad", label="zero_grad", kind="choice",
              default=_default(T, "zero_grad"), choices=jobs.ZERO_GRADS, section="advanced",
              help="where zero_grad(set_to_none=True) runs"),
    FormField(task="train", name="loop", label="training loop", kind="choice",
              default=_default(T, "loop"), choices=jobs.LOOPS, section="advanced",
              help="drop-output: loss = model(...).loss (HF Trainer); hold-output: out = "
              "model(...) kept until the next forward; del-logits: the loop computes the loss "
              "and deletes the logits (torchtitan)"),
    FormField(task="train", name="loss", label="loss", kind="choice",
              default=_default(T, "loss"), choices=jobs.LOSSES, section="advanced",
              help="cross-entropy: the model's own; chunked-ce: torchtune-style chunks, each "
              "upcast in turn; sum: logits.sum() (benchmarks)"),
    FormField(task="train", name="optimizer_in_backward", label="optimizer in backward",
              kind="bool", default=False, section="advanced",
              help="torchtune's optimizer_in_bwd: each parameter stepped once its gradient "
              "is ready"),
    FormField(task="train", name="offload_activations", label="offload activations",
              kind="bool", default=False, section="advanced",
              help="with recompute full: torchtune's enable_activation_offloading, or "
              "transformers' activation_checkpointing_enable(offload=True) (hf): saved "
              "activations in pinned host memory, brought back in backward"),
    FormField(task="train", name="paged_optimizer", label="paged optimizer", kind="bool",
              default=False, section="advanced",
              help="bitsandbytes' paged adam8bit/adam32bit (paged_adamw_8bit/32bit): states of "
              "params of 100,000+ elements in CUDA managed memory, outside the peak"),
    FormField(task="train", name="loss_chunks", label="loss chunks", kind="int",
              default=_default(T, "loss_chunks"), high=jobs.MAX_LOSS_CHUNKS, section="advanced",
              help="chunks of the chunked cross-entropy"),
    FormField(task="train", name="compile", label="torch.compile", kind="choice",
              default=_default(T, "compile"), choices=jobs.COMPILES, section="advanced",
              help="none: eager; default: torch.compile(model), one GPU: recorded from "
              "Inductor's generated code at this batch and sequence (seconds per new size)"),
)  # fmt: skip

NONE = "none"
"""The choice that leaves an object-valued job field at None."""
SAMPLE = "sample"
"""The ``do_sample`` option that turns sampling on (``calc.Sampling``)."""
INFERENCE: tuple[FormField, ...] = (
    FormField(task="infer", name="batch", label="batch", kind="int", default=1, high=1 << 20,
              help="sequences served together"),
    FormField(task="infer", name="context", label="context (KV-cache tokens)", kind="int",
              default=4096, high=1 << 24, help="tokens the KV cache holds per sequence"),
    FormField(task="infer", name="prompt", label="prompt tokens", kind="optional_int",
              default=_default(I, "prompt"), high=1 << 24,
              help="tokens in the prefill; empty = the whole context"),
    FormField(task="infer", name="precision", label="precision", kind="choice",
              default=_default(I, "precision"), choices=jobs.INFERENCE_PRECISIONS),
    FormField(task="infer", name="attention", label="attention", kind="choice",
              default=_default(I, "attention"), choices=jobs.ATTENTIONS),
    FormField(task="infer", name="implementation", label="modeling code", kind="choice",
              default=_default(I, "implementation"), choices=jobs.INFERENCE_IMPLEMENTATIONS,
              section="advanced"),
    FormField(task="infer", name="new_tokens", label="new tokens (generate)", kind="int",
              default=0, low=0, high=1 << 24,
              help="tokens HF generate makes after the prompt (greedy); 0 = the prefill alone. "
                   "Above 0 the context is prompt + new tokens"),
    FormField(task="infer", name="cache", label="generate's KV cache", kind="choice",
              default="dynamic", choices=jobs.CACHE_IMPLS, section="advanced",
              help="DynamicCache (generate's default, grown each step) or a static cache; "
                   "used when new tokens > 0"),
    FormField(task="infer", name="num_beams", label="beams (generate)", kind="int",
              default=1, low=1, high=jobs.MAX_BEAMS, section="advanced",
              help="beam search of this many beams per sequence (1 = none): the cache and "
                   "logits of batch x beams rows; used when new tokens > 0"),
    FormField(task="infer", name="num_return_sequences", label="sequences per prompt (generate)",
              kind="int", default=1, low=1, high=jobs.MAX_RETURN_SEQUENCES, section="advanced",
              help="num_return_sequences: more than 1 needs sampling (each prompt decoded as "
                   "that many rows) or at least as many beams; used when new tokens > 0"),
    FormField(task="infer", name="output_scores", label="keep scores (generate)", kind="bool",
              default=False, section="advanced",
              help="output_scores=True with return_dict_in_generate: each step's fp32 scores "
                   "kept until generate returns; used when new tokens > 0"),
    FormField(task="infer", name="output_logits", label="keep logits (generate)", kind="bool",
              default=False, section="advanced",
              help="output_logits=True: each step's raw fp32 logits kept the same way"),
    FormField(task="infer", name="padding", label="prompt padding", kind="choice",
              default=_default(I, "padding"), choices=jobs.PADDINGS, section="advanced",
              help="none = prompts of one length; left = prompts of different lengths padded "
                   "on the left, their attention mask passed (a 4-D mask each forward)"),
    FormField(task="infer", name="do_sample", label="sampling (generate)", kind="choice",
              default=NONE, choices=(NONE, SAMPLE), section="advanced", of="sampling",
              help="none = greedy; sample = do_sample=True with the logits processors below "
                   "(used when new tokens > 0)"),
    FormField(task="infer", name="temperature", label="temperature", kind="float",
              default=1.0, low=1e-3, high=1e3, section="advanced", of="sampling",
              needs="do_sample", help="1 = not applied"),
    FormField(task="infer", name="top_k", label="top-k", kind="int", default=50, low=0,
              high=jobs.MAX_TOP_K, section="advanced", of="sampling", needs="do_sample",
              help="0 = not applied (transformers' default: 50)"),
    FormField(task="infer", name="top_p", label="top-p", kind="float", default=1.0,
              low=1e-3, high=1.0, section="advanced", of="sampling", needs="do_sample",
              help="1 = not applied; below 1 the whole vocabulary is sorted each step"),
    FormField(task="infer", name="repetition_penalty", label="repetition penalty",
              kind="float", default=1.0, low=1e-3, high=1e3, section="advanced",
              of="sampling", needs="do_sample", help="1 = not applied"),
)  # fmt: skip

_PAR = "parallel"
PARALLELISM: tuple[FormField, ...] = (
    FormField(task="train", name="dp", label="data parallel (dp)", kind="int", default=1,
              high=MAX_DEGREE, section="parallelism", of=_PAR,
              help="replicas (or shards, with ZeRO/FSDP) of the model"),
    FormField(task="train", name="tp", label="tensor parallel (tp)", kind="int", default=1,
              high=MAX_DEGREE, section="parallelism", of=_PAR,
              help="Megatron column/row splits of attention and MLP"),
    FormField(task="train", name="pp", label="pipeline parallel (pp)", kind="int", default=1,
              high=MAX_DEGREE, section="parallelism", of=_PAR, help="pipeline stages"),
    FormField(task="train", name="cp", label="context parallel (cp)", kind="int", default=1,
              high=MAX_DEGREE, section="parallelism", of=_PAR,
              help="every activation's sequence split over cp ranks"),
    FormField(task="train", name="zero", label="ZeRO stage", kind="int", default=0, low=0,
              high=3, section="parallelism", of=_PAR,
              help="over dp: 0 DDP, 1 optimizer states, 2 + gradients, 3 + parameters sharded"),
    FormField(task="train", name="fsdp", label="FSDP", kind="bool", default=False,
              section="parallelism", of=_PAR, help="per layer and root (ZeRO-3 sharding)"),
    FormField(task="train", name="fsdp_version", label="FSDP version", kind="int", default=2,
              low=1, high=2, section="parallelism", of=_PAR,
              help="2: fully_shard; 1: FullyShardedDataParallel (flat parameters; recorded, "
              "LitGPT's FSDPStrategy by hand)"),
    FormField(task="train", name="fsdp_use_orig_params", label="FSDP1 use_orig_params",
              kind="bool", default=False, section="parallelism", of=_PAR,
              help="needed for LoRA under FSDP1; the flat gradient covers frozen parameters"),
    FormField(task="train", name="reshard_after_forward", label="FSDP reshard after forward",
              kind="bool", default=True, section="parallelism", of=_PAR),
    FormField(task="train", name="sp", label="sequence parallel (with tp)", kind="bool",
              default=False, section="parallelism", of=_PAR),
    FormField(task="train", name="expert_parallel", label="expert parallel (with tp)",
              kind="bool", default=False, section="parallelism", of=_PAR,
              help="derived MoE models: the experts spread over the tp ranks (transformers)"),
    FormField(task="train", name="vocab_parallel", label="vocabulary parallel (with tp)",
              kind="bool", default=False, section="parallelism", of=_PAR),
    FormField(task="train", name="pp_schedule", label="pipeline schedule", kind="choice",
              default="1f1b", choices=PIPELINE_SCHEDULES, section="parallelism", of=_PAR),
    FormField(task="train", name="pp_microbatches", label="pipeline micro-batches", kind="int",
              default=1, high=1 << 16, section="parallelism", of=_PAR,
              help="micro-batches per optimizer step through the pipeline"),
    FormField(task="train", name="pp_virtual_stages", label="virtual stages per rank",
              kind="int", default=1, high=1 << 10, section="parallelism", of=_PAR,
              help="model chunks per pipeline rank (interleaved-1f1b)"),
    FormField(task="train", name="offload", label="CPU offload", kind="choice", default="none",
              choices=OFFLOADS, section="parallelism", of=_PAR),
    FormField(task="train", name="fsdp_param_dtype", label="FSDP2 param_dtype", kind="choice",
              default="none", choices=FSDP_PARAM_DTYPES, section="parallelism", of=_PAR,
              help="MixedPrecisionPolicy: bf16 all-gathers of fp32 shards (precision fp32)"),
    FormField(task="train", name="fsdp_reduce_dtype", label="FSDP2 reduce_dtype",
              kind="choice", default="none", choices=FSDP_REDUCE_DTYPES, section="parallelism",
              of=_PAR, help="MixedPrecisionPolicy: the reduce-scatter's dtype"),
    FormField(task="train", name="fsdp_output_dtype", label="FSDP2 output_dtype",
              kind="choice", default="none", choices=FSDP_REDUCE_DTYPES, section="parallelism",
              of=_PAR, help="the root's MixedPrecisionPolicy: cast the model's outputs (logits)"),
    FormField(task="train", name="fsdp_cast_forward_inputs", label="FSDP2 cast_forward_inputs",
              kind="bool", default=True, section="parallelism", of=_PAR,
              help="MixedPrecisionPolicy: cast each module's float inputs to param_dtype"),
    FormField(task="train", name="dp_replicate", label="HSDP replicas", kind="int", default=1,
              high=1 << 20, section="parallelism", of=_PAR,
              help="with FSDP2: replica groups, each sharding the model over dp / replicas"),
    FormField(task="train", name="ddp_bucket_mib", label="DDP bucket (MiB)",
              kind="optional_int", default=None, high=1 << 20, section="parallelism", of=_PAR,
              help="bucket_cap_mb; empty = PyTorch's (1 MiB first bucket, then 25 MiB)"),
    FormField(task="train", name="gradient_as_bucket_view", label="DDP gradient_as_bucket_view",
              kind="bool", default=False, section="parallelism", of=_PAR),
    FormField(task="train", name="zero_partition", label="ZeRO-1 partition", kind="choice",
              default="shard", choices=ZERO_PARTITIONS, section="parallelism", of=_PAR,
              help="shard: every state split over dp; by-parameter: ZeroRedundancyOptimizer"),
)  # fmt: skip
"""Issue 4: one option per field of ``calc.Parallelism`` (training only); all at their defaults
is one GPU (``build_parallel`` returns None)."""

AUTO = "auto"
"""The choice that leaves an option at the class's default (None)."""
ZERO_POINTS: dict[str, bool | None] = {AUTO: None, "yes": True, "no": False}


def _quant_fields(task: str) -> tuple[FormField, ...]:
    sec, of = "compression", "quant"
    return (
        FormField(task=task, name="quant", label="weight quantization", kind="choice",
                  default=NONE, choices=(NONE, *QUANT_METHODS), section=sec, of=of,
                  help="weight-only quantization of the decoder linears"
                  + (" (the frozen base of QLoRA: needs a LoRA rank)" if task == "train" else "")),
        FormField(task=task, name="group_size", label="quantization group size",
                  kind="optional_int", default=None, high=MAX_GROUP, section=sec, of=of,
                  needs="quant", help="elements per scale; empty = int8 per row, int4 128, nf4 64"),
        FormField(task=task, name="zero_point", label="zero points (int8/int4)", kind="choice",
                  default=AUTO, choices=tuple(ZERO_POINTS), section=sec, of=of, needs="quant",
                  help="auto: int8 symmetric, int4 asymmetric"),
        FormField(task=task, name="scale_dtype", label="scale dtype (int8/int4)", kind="choice",
                  default=AUTO, choices=(AUTO, *SCALE_DTYPES), section=sec, of=of,
                  needs="quant", help="auto: int8 fp32, int4 fp16"),
        FormField(task=task, name="double_quant", label="nf4 double quantization", kind="bool",
                  default=True, section=sec, of=of, needs="quant"),
        FormField(task=task, name="fp8_scaling", label="fp8 scaling", kind="choice",
                  default="tensor", choices=FP8_SCALINGS, section=sec, of=of, needs="quant"),
        FormField(task=task, name="quant_lm_head", label="quantize the LM head too", kind="bool",
                  default=False, section=sec, of=of, needs="quant",
                  help="every nn.Linear, as Lightning's bitsandbytes plugin does"),
    )  # fmt: skip


COMPRESSION: tuple[FormField, ...] = (
    FormField(task="train", name="lora_rank", label="LoRA rank", kind="optional_int",
              default=None, high=MAX_RANK, section="compression", of="lora",
              help="empty = train every weight; a rank trains LoRA adapters on a frozen base"),
    FormField(task="train", name="lora_alpha", label="LoRA alpha", kind="optional_float",
              default=None, low=1e-6, high=1e6, section="compression", of="lora",
              needs="lora_rank", help="empty = the rank (changes values, not memory)"),
    FormField(task="train", name="lora_modules", label="LoRA modules", kind="multi",
              default=DECODER_LORA_MODULES, choices=LORA_MODULES, section="compression", of="lora",
              needs="lora_rank", help="projections of each layer that get an adapter"),
    FormField(task="train", name="lora_dropout", label="LoRA dropout", kind="float",
              default=0.0, low=0.0, high=0.95, section="compression", of="lora",
              needs="lora_rank", help="peft's lora_dropout: above 0 each adapter keeps a dropped "
              "copy of its input and the mask"),
    *_quant_fields("train"),
    FormField(task="train", name="prune", label="pruning", kind="choice", default=NONE,
              choices=(NONE, *PRUNING_KINDS), section="compression", of="pruning",
              help="torch.nn.utils.prune reparameterisation of the layers' linears"),
    FormField(task="train", name="prune_amount", label="pruned fraction",
              kind="optional_float", default=None, low=0.0, high=1.0, section="compression",
              of="pruning", needs="prune", help="empty = 0.5 (2:4 is always 0.5)"),
    FormField(task="train", name="prune_modules", label="pruned modules", kind="multi",
              default=(), choices=LLAMA_MODULES + GPT2_MODULES, section="compression",
              of="pruning", needs="prune",
              help="empty = every linear (llama: q k v o gate up down; GPT-2: qkv o fc proj)"),
    FormField(task="train", name="prune_removed", label="prune.remove ran", kind="bool",
              default=False, section="compression", of="pruning", needs="prune",
              help="the weights are dense again (zeros included)"),
    FormField(task="train", name="teacher", label="distillation teacher", kind="choice",
              default=NONE, choices=(NONE, *calc.list_cards()), section="compression",
              of="distill", help="knowledge distillation from a frozen teacher (a model card)"),
    FormField(task="train", name="teacher_precision", label="teacher precision", kind="choice",
              default="bf16", choices=TEACHER_PRECISIONS, section="compression", of="distill",
              needs="teacher"),
    FormField(task="train", name="teacher_quant", label="teacher quantization", kind="choice",
              default=NONE, choices=(NONE, *QUANT_METHODS), section="compression",
              of="distill", needs="teacher"),
    FormField(task="train", name="distill_temperature", label="distillation temperature",
              kind="float", default=1.0, low=1e-3, high=MAX_TEMPERATURE, section="compression",
              of="distill", needs="teacher"),
    FormField(task="train", name="distill_hard_weight", label="hard-label CE weight",
              kind="float", default=0.0, low=0.0, high=MAX_TEMPERATURE, section="compression",
              of="distill", needs="teacher"),
    *_quant_fields("infer"),
    FormField(task="infer", name="kv_quant", label="KV-cache quantization", kind="choice",
              default=NONE, choices=(NONE, *KV_QUANTS), section="compression", of="kv_quant",
              help="int8: a scale per token and head; fp8: e4m3, a scale per layer"),
)  # fmt: skip
"""Issue 5 (LoRA / QLoRA / quantization / pruning / distillation): flat options, each part of
one object-valued job field (``of``), built by ``OBJECT_BUILDERS`` with the CLI's helpers
(``calc.cli.compression``, ``calc.cli.prune_distill``): a link and a command line mean the
same job."""


def _quant(v: Mapping[str, object]) -> calc.Quant | None:
    if v["quant"] == NONE:
        return None
    args = argparse.Namespace(
        quant=v["quant"],
        group_size=v["group_size"],
        zero_point=ZERO_POINTS[str(v["zero_point"])],
        scale_dtype=None if v["scale_dtype"] == AUTO else v["scale_dtype"],
        fp8_scaling=v["fp8_scaling"],
        no_double_quant=not v["double_quant"],
        quant_lm_head=bool(v["quant_lm_head"]),
    )
    return cli_compression.quant_of(args)


def _lora(v: Mapping[str, object]) -> calc.LoRA | None:
    if v["lora_rank"] is None:
        return None
    modules = v["lora_modules"]
    if not modules:
        raise ValueError(f"lora_modules=() must name at least one of {', '.join(LORA_MODULES)}")
    args = argparse.Namespace(
        lora_rank=v["lora_rank"],
        lora_alpha=v["lora_alpha"],
        lora_modules=",".join(modules),
        lora_dropout=v["lora_dropout"] or None,
    )
    return cli_compression.lora_of(args)


def _kv_quant(v: Mapping[str, object]) -> str | None:
    return None if v["kv_quant"] == NONE else str(v["kv_quant"])


def _pruning(v: Mapping[str, object]) -> Pruning | None:
    if v["prune"] == NONE:
        return None
    args = argparse.Namespace(
        prune=v["prune"],
        prune_amount=v["prune_amount"],
        prune_modules=",".join(v["prune_modules"]),  # type: ignore[arg-type]
        prune_removed=bool(v["prune_removed"]),
    )
    return cli_prune_distill.pruning_of(args)


def _distill(v: Mapping[str, object]) -> calc.Distill | None:
    if v["teacher"] == NONE:
        return None
    quant = None if v["teacher_quant"] == NONE else calc.Quant(method=v["teacher_quant"])
    return calc.Distill(
        teacher=calc.load_card(str(v["teacher"])),
        teacher_precision=v["teacher_precision"],  # type: ignore[arg-type]
        temperature=v["distill_temperature"],  # type: ignore[arg-type]
        hard_weight=v["distill_hard_weight"],  # type: ignore[arg-type]
        teacher_quant=quant,
    )


def _optimizer(v: Mapping[str, object]) -> object:
    """``none`` in the form is ``optimizer=None``: forward and backward alone."""
    return None if v["optimizer"] == NONE else v["optimizer"]


def _sampling(v: Mapping[str, object]) -> calc.Sampling | None:
    if v["do_sample"] == NONE:
        return None
    names = ("temperature", "top_k", "top_p", "repetition_penalty")
    return calc.Sampling(**{name: v[name] for name in names})  # type: ignore[arg-type]


OBJECT_BUILDERS: dict[str, Callable[[Mapping[str, object]], object]] = {
    "optimizer": _optimizer,
    "lora": _lora,
    "quant": _quant,
    "kv_quant": _kv_quant,
    "pruning": _pruning,
    "distill": _distill,
    "sampling": _sampling,
}
"""Job field -> the function building its value from its flat options (name -> value)."""

FIELDS: tuple[FormField, ...] = TRAINING + INFERENCE + PARALLELISM + COMPRESSION
SECTIONS: tuple[str, ...] = ("job", "parallelism", "compression", "advanced")

# Inputs that are not job fields: key -> default. `gpu` and the planner's keys are validated by
# the page against the GPU catalog.
PAGE_DEFAULTS: dict[str, object] = {
    "source": "card",
    "card": DEFAULT_CARD,
    "task": "train",
    "gpu": "",
    "device": "cuda",
    "config": "",
    "hf_id": "",
    "plan.task": "",
    "plan.global_batch": 8,
    "plan.gpu_count": 1,
    "plan.rank_by": "throughput",
    "plan.explore": ["precision", "recompute"],
}

PLAN_PARAMS: dict[str, str] = {
    "plan_task": "plan.task",
    "global_batch": "plan.global_batch",
    "gpu_count": "plan.gpu_count",
    "rank_by": "plan.rank_by",
    "explore": "plan.explore",
}
"""The planner page's URL query parameters -> state keys (validated by ``parse_plan``)."""
PLAN_TASKS: tuple[str, ...] = plan.TASKS
RANK_BYS: tuple[str, ...] = plan.RANK_BYS
EXPLORE_AXES: tuple[str, ...] = tuple(a.name for a in AXES if a.enumerated and not a.size)
"""Axes the planner may enumerate besides the micro-batch (``calc.plan.axes``: enumerated by
default, not a size; an axis another issue registers there appears here); the others hold the
sidebar job's value. Fewer axes, fewer structures to compile on first use (0.3-0.8 s each)."""
MAX_GPU_COUNT = 4096
BOOL_TEXT: dict[str, bool] = {"true": True, "false": False}
"""How a ``bool`` option is written in the URL."""


def fields_of(task: str) -> tuple[FormField, ...]:
    """The form fields of one task, in display order."""
    return tuple(f for f in FIELDS if f.task == task)


def defaults() -> dict[str, object]:
    """The state of a fresh page: every widget key at its default."""
    return {**PAGE_DEFAULTS, **{f.key: f.default for f in FIELDS}}


def _values(task: str, target: str, state: Mapping[str, object]) -> dict[str, object]:
    """The options of one job field (or ``parallel``) by name; an option whose switch
    (``needs``) is off takes its default."""
    fields = [f for f in fields_of(task) if f.target == target]
    values = {f.name: state.get(f.key, f.default) for f in fields}
    for f in fields:
        if f.needs and values[f.needs] in (None, NONE):
            values[f.name] = f.default
    return values


def build_job(task: str, state: Mapping[str, object]) -> calc.Training | calc.Inference:
    """The ``calc.Training`` or ``calc.Inference`` the state describes (the job class and the
    compression configs validate every field and raise ``ValueError`` naming it)."""
    jobs.check_choice("task", task, TASKS)
    kwargs: dict[str, object] = {}
    for target in dict.fromkeys(f.target for f in fields_of(task)):
        if target == _PAR:
            continue
        values = _values(task, target, state)
        kwargs[target] = (
            OBJECT_BUILDERS[target](values) if target in OBJECT_BUILDERS else values[target]
        )
    if task == "infer":
        _generate_fields(kwargs)
    return JOB_CLASS[task](**kwargs)


def _generate_fields(kwargs: dict[str, object]) -> None:
    """Generate (``new_tokens`` > 0): the context follows from the prompt (``context=0``);
    the prefill alone: no ``cache`` choice (its cache is the static one), no sampling, no
    beams, one sequence per prompt, nothing kept."""
    if kwargs.get("new_tokens"):
        kwargs["context"] = 0
    else:
        kwargs["cache"] = None
        kwargs["sampling"] = None
        kwargs["num_beams"] = 1
        kwargs["num_return_sequences"] = 1
        kwargs["output_scores"] = kwargs["output_logits"] = False


def build_parallel(task: str, state: Mapping[str, object]) -> calc.Parallelism | None:
    """The ``calc.Parallelism`` the state describes (training), or None for one GPU (every
    option at its default, or inference); ``ValueError`` naming a bad field."""
    if task != "train":
        return None
    values = _values(task, _PAR, state)
    if all(values[f.name] == f.default for f in PARALLELISM):
        return None
    return calc.Parallelism(**values)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- URL


def parse_value(field: FormField, text: str) -> object:
    """A query-string value as the field's type; ``ValueError`` naming the field and what is
    allowed. Numbers are parsed with ``int``/``float``, never evaluated."""
    text = text.strip()
    if field.kind == "choice":
        jobs.check_choice(field.name, text, field.choices)
        return text
    if field.kind == "bool":
        if text not in BOOL_TEXT:
            raise ValueError(f"{field.name}={text!r} is not one of 'true', 'false'")
        return BOOL_TEXT[text]
    if field.kind == "multi":
        items = [t.strip() for t in text.split(",") if t.strip()]
        for item in items:
            jobs.check_choice(field.name, item, field.choices)
        return tuple(c for c in field.choices if c in items)
    if field.kind.startswith("optional") and text in ("", "none", "None"):
        return None
    is_int = field.kind in ("int", "optional_int")
    try:
        value: float = int(text) if is_int else float(text)
    except ValueError:
        kind = "an integer" if is_int else "a number"
        raise ValueError(
            f"{field.name}={text!r} must be {kind} in [{_bound(field.low)}, {_bound(field.high)}]"
        ) from None
    if not (math.isfinite(value) and field.low <= value <= field.high):
        raise ValueError(
            f"{field.name}={text!r} is out of range: allowed [{_bound(field.low)}, {_bound(field.high)}]"
        )
    return value


def parse_plan(key: str, text: str) -> object:
    """A planner query parameter as its value (``ValueError`` naming it and what is allowed)."""
    name = key.split(".", 1)[1]
    text = text.strip()
    if key == "plan.task":
        jobs.check_choice(name, text, PLAN_TASKS)
        return text
    if key == "plan.rank_by":
        jobs.check_choice(name, text, RANK_BYS)
        return text
    if key == "plan.explore":
        axes = [a for a in text.split(",") if a]
        for axis in axes:
            jobs.check_choice(name, axis, EXPLORE_AXES)
        return axes
    high = MAX_GPU_COUNT if key == "plan.gpu_count" else 1 << 24
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} must be an integer in [1, {high}]") from None
    jobs.check_size(name, value, 1, high)
    return value


def _first(value: object) -> str:
    if isinstance(value, list | tuple):
        return str(value[0]) if value else ""
    return str(value)


def known_params() -> set[str]:
    """Every query parameter a link may carry: the page's, the planner's and each task's fields."""
    fields = {f.name for task in TASKS for f in fields_of(task)}
    return {"task", "card", "gpu", "device", "config", "model", *PLAN_PARAMS, *fields}


def _bound(x: float) -> str:
    """A range bound as people write it: ``1,048,576`` rather than ``1.04858e+06``."""
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def _catalog_values(
    get: Mapping[str, str], state: dict[str, object], cards: tuple[str, ...], gpus: tuple[str, ...]
) -> list[str]:
    """Card, GPU and device from the link into ``state``; a warning naming the default kept for
    each value that is not in its catalog."""
    catalog = (
        ("card", cards, "is not a known model card"),
        ("gpu", gpus, "is not in the GPU catalog"),
        ("device", jobs.DEVICES, f"is not one of {jobs.DEVICES}"),
    )
    warnings = []
    for name, known, why in catalog:
        if name not in get:
            continue
        value = get[name].strip().lower() if name == "card" else get[name]
        if value in known:
            state[name] = value
        else:
            kept = repr(state[name]) if state[name] else f"the default {name}"
            warnings.append(f"{name}={get[name]!r} {why}: using {kept}")
    return warnings


def _custom_model(get: Mapping[str, str], state: dict[str, object]) -> None:
    """A link's pasted config (``config=``) or Hugging Face id (``model=``, checked when the
    page loads it) into the page state."""
    if "config" in get:
        state["source"] = "paste"
        state["config"] = get["config"]
    if "model" in get:
        state["source"] = "hub"
        state["hf_id"] = get["model"].strip()


def from_query(
    params: Mapping[str, object], cards: tuple[str, ...], gpus: tuple[str, ...]
) -> tuple[dict[str, object], list[str]]:
    """The page state a URL's query parameters describe, and one warning per parameter that was
    ignored (unknown value, out of range). Missing parameters take their defaults."""
    state = defaults()
    warnings: list[str] = []
    get = {k: _first(v) for k, v in params.items()}
    known = known_params()
    unknown = sorted(set(get) - known)
    if unknown:
        names = ", ".join(map(repr, unknown))
        warnings.append(
            f"unknown link parameter {names} ignored; known: {', '.join(sorted(known))}"
        )
    task = get.get("task", "train")
    if task not in TASKS:
        warnings.append(f"task={task!r} is not one of {TASKS}: using 'train'")
        task = "train"
    state["task"] = task
    warnings += _catalog_values(get, state, cards, gpus)
    _custom_model(get, state)
    for param, key in PLAN_PARAMS.items():
        if param in get:
            try:
                state[key] = parse_plan(key, get[param])
            except ValueError as exc:
                warnings.append(f"{exc}: using {state[key]!r}")
    for field in fields_of(task):
        if field.name not in get:
            continue
        try:
            state[field.key] = parse_value(field, get[field.name])
        except ValueError as exc:
            warnings.append(f"{exc}: using {field.default!r}")
    return state, warnings


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return ",".join(map(str, value))
    if isinstance(value, float):
        return repr(value)
    return str(value)


def to_query(state: Mapping[str, object], config: Mapping[str, object] | None = None) -> dict:
    """The query parameters of a shareable link: the task, the model (card id, Hugging Face id,
    or a custom config as minified JSON when it is short enough), the GPU, and the job fields of the
    selected task that differ from their defaults."""
    task = str(state.get("task", "train"))
    out: dict[str, str] = {"task": task}
    if state.get("source") == "hub" and str(state.get("hf_id", "")).strip():
        out["model"] = str(state["hf_id"]).strip()
    elif state.get("source", "card") == "card" or config is None:
        out["card"] = str(state.get("card", DEFAULT_CARD))
    else:
        text = json.dumps(config, separators=(",", ":"), sort_keys=True)
        if len(text) <= MAX_URL_CONFIG_CHARS:
            out["config"] = text
    if state.get("gpu"):
        out["gpu"] = str(state["gpu"])
    if state.get("device", "cuda") != "cuda":
        out["device"] = str(state["device"])
    for param, key in PLAN_PARAMS.items():
        value = state.get(key, PAGE_DEFAULTS[key])
        if value != PAGE_DEFAULTS[key]:
            out[param] = ",".join(value) if isinstance(value, list) else str(value)
    for field in fields_of(task):
        value = state.get(field.key, field.default)
        if value != field.default:
            out[field.name] = "" if value is None else _text(value)
    return out
