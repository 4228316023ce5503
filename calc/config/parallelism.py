"""How a training step is spread over GPUs: the `Parallelism` config and its divisibility checks.

Every parallel degree and sharding choice that changes a rank's memory is a field of
`Parallelism`; invalid values raise ``ValueError`` naming the field, the value and what is
allowed. `check_divisibility` checks a model against a layout (tensor parallelism must split
the attention heads and the MLP evenly, pipeline parallelism must place the layers on stages).

Conventions (what PyTorch and Megatron-LM do, cited per field):

* ``dp`` is the data-parallel degree; ``zero`` and ``fsdp`` say what is sharded over it.
  ``fsdp=True`` means PyTorch FSDP2 ``fully_shard`` on every layer and on the root: parameters,
  gradients and optimizer states sharded over dp (ZeRO-3, Rajbhandari et al. 2020, §5).
* ``tp`` splits attention and MLP as Megatron-LM does (Shoeybi et al. 2019, §3), ``sp``
  additionally splits the norm/dropout activations along the sequence (Korthikanti et al. 2022,
  §4.2.2), ``cp`` splits the sequence of every activation (context parallelism).
* ``pp`` places the layers on stages; ``pp_schedule`` and ``pp_microbatches`` decide how many
  micro-batches of activations a stage holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from calc.config.checks import check_bool, check_choice, check_size
from calc.config.model_spec import ModelSpec

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
Offload = Literal["none", "optimizer", "optimizer+params"]
ZeroPartition = Literal["shard", "by-parameter"]
FsdpDtype = Literal["none", "bf16", "fp32"]

PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
OFFLOADS: tuple[str, ...] = get_args(Offload)
ZERO_PARTITIONS: tuple[str, ...] = get_args(ZeroPartition)
FSDP_PARAM_DTYPES: tuple[str, ...] = ("none", "bf16")
FSDP_VERSIONS: tuple[int, ...] = (1, 2)
FSDP_REDUCE_DTYPES: tuple[str, ...] = get_args(FsdpDtype)
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)

MAX_DEGREE = 1 << 20
"""Upper bound on any parallel degree (beyond any real cluster; guards typos)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallelism:
    """The parallel layout of one training job; ``Parallelism()`` is a single GPU."""

    dp: int = 1
    """Data-parallel degree: replicas (or shards, with ``zero``/``fsdp``) of the model."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row splits of attention and MLP)."""
    pp: int = 1
    """Pipeline-parallel degree: stages the layers are placed on."""
    sp: bool = False
    """Sequence parallelism with tp: norm and dropout activations split along the sequence."""
    cp: int = 1
    """Context-parallel degree: every activation's sequence split over ``cp`` ranks."""
    zero: int = 0
    """ZeRO stage over dp: 0 (DDP, everything replicated), 1 (optimizer states sharded),
    2 (+ gradients), 3 (+ parameters)."""
    fsdp: bool = False
    """PyTorch FSDP2 ``fully_shard`` on each layer and the root (implies ZeRO-3 sharding:
    ``zero`` must be 0 or 3)."""
    reshard_after_forward: bool = True
    """FSDP2: free each layer's all-gathered parameters after its forward (re-gathered in the
    backward); False keeps them from the forward to the backward."""
    pp_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule: ``gpipe``, ``1f1b`` or ``interleaved-1f1b``."""
    pp_microbatches: int = 1
    """Micro-batches per optimizer step through the pipeline."""
    pp_virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B; 1 otherwise)."""
    offload: Offload = "none"
    """CPU offload: ``optimizer`` (optimizer states and their update on the CPU, ZeRO-Offload)
    or ``optimizer+params`` (parameters too, ZeRO-Infinity style)."""
    ddp_bucket_mib: int | None = None
    """DDP ``bucket_cap_mb``: None is PyTorch's default (25 MiB buckets after a 1 MiB first
    bucket); a number caps every bucket, the first included (as passing it to DDP does)."""
    gradient_as_bucket_view: bool = False
    """DDP: gradients are views into the buckets (no second copy of the gradients)."""
    zero_partition: ZeroPartition = "shard"
    """How ZeRO-1 splits the optimizer states over dp: ``shard`` (every state tensor's dim 0
    split over dp, padded, as FSDP2 and DeepSpeed's flat partitions do: 1/dp each) or
    ``by-parameter`` (whole parameters per rank, largest first to the least-loaded rank:
    ``torch.distributed.optim.ZeroRedundancyOptimizer``)."""
    expert_parallel: bool = False
    """With ``tp`` on a derived mixture-of-experts model: the experts spread over the tp ranks
    (transformers' ``DistributedConfig(ep_size=tp)``, the model's ``base_model_ep_plan``: each
    rank holds ``E / tp`` whole experts) instead of every expert split by the tp plan."""
    vocab_parallel: bool = False
    """With tp: the embedding split over the vocabulary and a vocabulary-parallel loss (else the
    embedding and the head are replicated on every tp rank)."""
    fsdp_param_dtype: FsdpDtype = "none"
    """FSDP2 ``MixedPrecisionPolicy(param_dtype=...)``: ``bf16`` all-gathers the fp32 sharded
    parameters as bf16 (forward and backward in bf16; fp32 shards, gradients and optimizer
    states); ``none``: no policy (the parameters' own dtype)."""
    fsdp_reduce_dtype: FsdpDtype = "none"
    """FSDP2 ``MixedPrecisionPolicy(reduce_dtype=...)``: the reduce-scatter's dtype, ``fp32`` or
    ``bf16``; ``none``: the gradients' (``param_dtype``)."""
    fsdp_cast_forward_inputs: bool = True
    """FSDP2 ``MixedPrecisionPolicy(cast_forward_inputs=...)``: each sharded module casts its
    floating-point inputs to ``param_dtype``. Same bytes either way here (the reference
    model's fp32 RoPE tables are cast per layer at its entry, or by ``.to(q.dtype)`` inside
    the attention; measured both ways). Passed as is to FSDP1's ``MixedPrecision`` too (whose
    own default is False)."""
    fsdp_output_dtype: FsdpDtype = "none"
    """FSDP2 ``MixedPrecisionPolicy(output_dtype=...)`` of the root ``fully_shard``: the model's
    floating-point outputs (logits, loss) cast to ``bf16`` or ``fp32`` (on every layer it would
    hand fp32 hidden states to the bf16 head); ``none``: no cast. Recorded from torch's own
    ``fully_shard`` (derived replay)."""
    fsdp_version: int = 2
    """Which PyTorch FSDP shards the model with ``fsdp=True``: 2, ``fully_shard`` (per-parameter
    DTensor shards); 1, ``FullyShardedDataParallel`` with ``ModuleWrapPolicy`` on the decoder
    layers (one flat parameter per layer and one for the rest; ``reshard_after_forward``
    chooses ``FULL_SHARD`` or ``SHARD_GRAD_OP``; the ``fsdp_*_dtype`` fields its
    ``MixedPrecision``). FSDP1 is recorded from torch's own code (derived replay)."""
    fsdp_use_orig_params: bool = False
    """FSDP1 ``use_orig_params``: the original parameters stay visible as views of the flat
    parameter (needed for LoRA, whose frozen and trained parameters share a flat parameter;
    the flat gradient then covers the frozen ones too)."""
    dp_replicate: int = 1
    """HSDP (FSDP2 ``fully_shard`` over a 2-D mesh ``(dp_replicate, dp / dp_replicate)``,
    torchtitan's ``dp_replicate`` x ``dp_shard``): each parameter is sharded over the
    ``dp / dp_replicate`` ranks of its group and replicated over ``dp_replicate`` groups, whose
    gradient shards are all-reduced; 1 is plain FSDP2 over all dp ranks."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp"):
            check_size(name, getattr(self, name), 1, MAX_DEGREE)
        for name in (
            "sp",
            "fsdp",
            "reshard_after_forward",
            "fsdp_cast_forward_inputs",
            "gradient_as_bucket_view",
            "vocab_parallel",
            "fsdp_use_orig_params",
            "expert_parallel",
        ):
            check_bool(name, getattr(self, name))
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise ValueError(f"zero={self.zero!r} is not one of 0, 1, 2, 3")
        check_choice("pp_schedule", self.pp_schedule, PIPELINE_SCHEDULES)
        check_size("pp_microbatches", self.pp_microbatches, 1, 1 << 16)
        check_size("pp_virtual_stages", self.pp_virtual_stages, 1, 1 << 10)
        check_choice("offload", self.offload, OFFLOADS)
        check_choice("zero_partition", self.zero_partition, ZERO_PARTITIONS)
        if self.zero_partition == "by-parameter" and self.shard_level != 1:
            raise ValueError(
                f"zero_partition='by-parameter' with zero={self.zero}, fsdp={self.fsdp}: "
                "ZeroRedundancyOptimizer's partition is a ZeRO-1 layout; allowed with zero=1 only"
            )
        if self.ddp_bucket_mib is not None:
            check_size("ddp_bucket_mib", self.ddp_bucket_mib, 1, 1 << 20)
        self._check_fsdp()
        if self.expert_parallel and self.tp == 1:
            raise ValueError("expert_parallel=True needs tp > 1 (the experts spread over tp ranks)")
        if self.sp and self.tp == 1:
            raise ValueError("sp=True needs tp > 1 (sequence parallelism splits over tp ranks)")
        if self.pp_virtual_stages > 1 and self.pp_schedule != "interleaved-1f1b":
            raise ValueError(
                f"pp_virtual_stages={self.pp_virtual_stages} needs "
                "pp_schedule='interleaved-1f1b' (other schedules run one chunk per rank)"
            )
        if self.offload == "optimizer+params" and self.shard_level < 3:
            raise ValueError(
                "offload='optimizer+params' needs zero=3 or fsdp=True "
                "(parameters are offloaded as shards, ZeRO-Infinity style)"
            )

    def _check_fsdp(self) -> None:
        """The FSDP fields: dtypes, version and options only where they apply."""
        check_choice("fsdp_param_dtype", self.fsdp_param_dtype, FSDP_PARAM_DTYPES)
        check_choice("fsdp_reduce_dtype", self.fsdp_reduce_dtype, FSDP_REDUCE_DTYPES)
        check_choice("fsdp_output_dtype", self.fsdp_output_dtype, FSDP_REDUCE_DTYPES)
        if self.fsdp_output_dtype != "none" and (not self.fsdp or self.fsdp_version != 2):
            raise ValueError(
                f"fsdp_output_dtype={self.fsdp_output_dtype!r} is FSDP2's MixedPrecisionPolicy"
                "(output_dtype): it needs fsdp=True and fsdp_version=2"
            )
        if (self.fsdp_param_dtype != "none" or self.fsdp_reduce_dtype != "none") and not (
            self.fsdp
        ):
            raise ValueError(
                "fsdp_param_dtype/fsdp_reduce_dtype set an FSDP2 MixedPrecisionPolicy: they "
                "need fsdp=True"
            )
        if self.fsdp_reduce_dtype != "none" and self.fsdp_param_dtype == "none":
            raise ValueError(
                f"fsdp_reduce_dtype={self.fsdp_reduce_dtype!r} without fsdp_param_dtype is not "
                "modelled: set fsdp_param_dtype='bf16'"
            )
        if self.fsdp and self.zero not in (0, 3):
            raise ValueError(
                f"zero={self.zero} with fsdp=True: FSDP2 fully_shard shards parameters, "
                "gradients and optimizer states (ZeRO-3); allowed zero: 0 or 3"
            )
        if isinstance(self.fsdp_version, bool) or self.fsdp_version not in FSDP_VERSIONS:
            raise ValueError(f"fsdp_version={self.fsdp_version!r} is not one of 1, 2")
        if self.fsdp_version == 1 and not self.fsdp:
            raise ValueError("fsdp_version=1 chooses FullyShardedDataParallel: it needs fsdp=True")
        check_size("dp_replicate", self.dp_replicate, 1, self.dp)
        if self.dp_replicate > 1 and (not self.fsdp or self.fsdp_version != 2):
            raise ValueError(
                f"dp_replicate={self.dp_replicate} is HSDP, FSDP2's 2-D mesh: it needs "
                "fsdp=True and fsdp_version=2"
            )
        if self.dp % self.dp_replicate:
            raise ValueError(
                f"dp_replicate={self.dp_replicate} must divide dp={self.dp} (each replica "
                "group shards the model over dp / dp_replicate ranks)"
            )
        if self.fsdp_use_orig_params and self.fsdp_version != 1:
            raise ValueError(
                "fsdp_use_orig_params=True is an option of FSDP1's FullyShardedDataParallel: it "
                "needs fsdp=True and fsdp_version=1"
            )

    # ------------------------------------------------------------------ derived

    @property
    def world_size(self) -> int:
        """GPUs in the job: dp x tp x pp x cp."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard_level(self) -> int:
        """ZeRO stage in effect: 3 with ``fsdp``, else ``zero``."""
        return 3 if self.fsdp else self.zero

    @property
    def shard_world(self) -> int:
        """Ranks each parameter is sharded over: ``dp / dp_replicate``."""
        return self.dp // self.dp_replicate

    @property
    def is_single(self) -> bool:
        """True when this is one GPU with nothing offloaded."""
        return self.world_size == 1 and self.offload == "none"


def check_divisibility(model: ModelSpec, parallel: Parallelism) -> None:
    """Raise ``ValueError`` when ``parallel`` cannot split ``model`` as its implementations do.

    Tensor parallelism (Megatron-LM column/row parallel linears, Shoeybi et al. 2019 §3; PyTorch
    ``ColwiseParallel``/``RowwiseParallel``) needs tp to divide the query heads, the KV heads
    (GQA: each rank holds whole KV heads; Megatron-LM requires ``num_attention_heads``,
    ``num_query_groups`` and ``ffn_hidden_size`` to be multiples of tp,
    ``megatron/training/arguments.py``; the model's ``view(b, s, heads, head_dim)`` needs whole
    heads on each rank), the MLP width and, for the vocab-parallel embedding and loss, the
    vocabulary. Sequence and
    context parallelism split the sequence, which is checked against a job's length by the
    estimate. Pipeline parallelism needs at least one layer per (virtual) stage; an uneven
    split is accepted and named by the estimate (the first stages take the extra layers).
    """
    tp = parallel.tp
    checks = [("n_heads", model.n_heads), ("n_kv_heads", model.n_kv_heads), ("ffn", model.ffn)]
    if parallel.vocab_parallel:
        checks.append(("vocab", model.vocab))
    for field, value in checks:
        if value % tp:
            raise ValueError(
                f"tp={tp} does not divide {field}={value} of {model.name}: "
                f"allowed tp: divisors of {field}"
            )
    chunks = parallel.pp * parallel.pp_virtual_stages
    if chunks > model.n_layers:
        raise ValueError(
            f"pp={parallel.pp} x pp_virtual_stages={parallel.pp_virtual_stages} = {chunks} "
            f"stages exceed n_layers={model.n_layers} of {model.name}: allowed at most "
            f"{model.n_layers} stages"
        )
    if parallel.pp_schedule == "interleaved-1f1b" and parallel.pp_microbatches % parallel.pp:
        raise ValueError(
            f"pp_microbatches={parallel.pp_microbatches} must be a multiple of pp={parallel.pp} "
            "for the interleaved 1F1B schedule (Narayanan et al. 2021, §2.2)"
        )


def layers_per_stage(n_layers: int, parallel: Parallelism) -> tuple[int, ...]:
    """Layers on each pipeline rank: an even split, the first ``n_layers % chunks`` chunks one
    layer more (``torch.distributed.pipelining`` and Megatron-LM's uneven split both load the
    earlier stages), summed over the virtual stages of each rank."""
    chunks = parallel.pp * parallel.pp_virtual_stages
    base, extra = divmod(n_layers, chunks)
    per_chunk = [base + (1 if i < extra else 0) for i in range(chunks)]
    return tuple(sum(per_chunk[r :: parallel.pp]) for r in range(parallel.pp))
