"""The derived replay: a model's step as calc events, from its real modeling code.

`derived_events` records the step at the grid points of the job's regime (`calc.derive.lift`),
fits each storage's size, and plays the stream on a `calc.replay.tape.Tape`: the events then go
through `calc.replay.timeline` and the compile like a hand-written replay's. Decoder layers that
are all alike are recorded five at a time (the timeline generalises five to any ``L``); layers
that differ in a repeating pattern (sliding and global attention, dense layers before MoE ones)
are recorded five patterns at a time (`calc.derive.period`); any other model whose layers
differ is recorded with all its layers and its candidates taken as they are (``exact``).

The fitted stream is cached on disk (`calc.data.cards.write_plan_cache`), keyed by the config,
the job's structure, the regime and the torch/transformers versions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import lru_cache, partial
from importlib import metadata, util
from typing import Any, TypeVar

from calc.config.hf_config import hf_config_dict
from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.data.bitsandbytes import BNB_OPTIMIZERS
from calc.data.cards import read_plan_cache, write_plan_cache
from calc.derive import generate, lift, progress
from calc.derive.book import DeriveError, Trace, second_step_sizes
from calc.derive.dropout import dropout_config
from calc.derive.native import LocalOptimizer, Rank
from calc.derive.period import Periodic, is_layer, periodic_layout
from calc.derive.record import (
    count_parameters,
    first_sentence,
    layer_signatures,
    layer_types,
    sdpa_supported,
    session,
    trainable_numels,
)
from calc.derive.sharding import Shard
from calc.models.attention import (
    attention_kernel,
    check_cuda_kernel,
    compute_16bit_of,
    cpu_backend,
)
from calc.replay.tape import Event, Tape, Tensor

T = TypeVar("T")

SCHEMA = 2
"""Version of the cached streams (part of the key): 2 since a config's checkpoint dtype no
longer sets the recorded model's dtype (`calc.derive.record.CHECKPOINT_DTYPE_KEYS`); streams
cached before were recorded in bf16 for every precision when the config said bfloat16."""
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
"""Config keys of the decoder layer count, in the order configs use them."""
WINDOW_KEYS = (
    "sliding_window", "attention_chunk_size", "max_position_embeddings", "n_positions",
)  # fmt: skip
"""Config keys of spans where the modeling code changes path (masks, caches, RoPE tables)."""
HETEROGENEOUS_KEYS = ("first_k_dense_replace", "mlp_only_layers", "moe_layer_freq")
"""Config keys that make some decoder layers differ from others."""
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
"""Config keys of the routed experts per layer (Mixtral, Qwen-MoE, DeepSeek)."""
MOE_NOTE = (
    "mixture of experts (transformers' grouped_mm experts): every expert buffer has tokens x "
    "top_k rows whatever the routing, so balanced and worst-case routing give these same bytes"
)
"""The note of a derived MoE estimate: both routing bounds equal."""
MOE_LORA_NOTE = (
    "LoRA on a mixture of experts: the routed experts (3-D parameters in transformers, not "
    "nn.Linear) get no adapter, as with peft's target_modules; gate/up/down adapters go on the "
    "shared experts and dense layers where the model has them"
)
"""The note of LoRA naming MLP projections on a mixture of experts (`calc.derive.lora`)."""


def is_moe(config: dict[str, Any]) -> bool:
    """Whether ``config`` has routed experts (a positive `EXPERT_KEYS` entry)."""
    return any(isinstance(v := config.get(key), int) and v > 0 for key in EXPERT_KEYS)


def check_experts(config: dict[str, Any]) -> None:
    """Refuse an experts implementation whose sizes follow the routing.

    transformers' default (``modeling_utils.py``, ``get_correct_experts_implementation``) is
    ``grouped_mm`` (``integrations/moe.py``, ``grouped_mm_experts_forward``): the tokens are
    sorted by expert into ``tokens x top_k`` rows, ``torch.histc`` gives the offsets, one
    ``grouped_mm`` runs every expert's weights, a reshape and sum folds the rows back: no size
    depends on which experts the router picks. ``"eager"`` loops over the experts hit
    (``nonzero``) and takes each one's tokens with ``torch.where``: sizes the router decides."""
    impl = config.get("experts_implementation")
    if is_moe(config) and impl not in (None, "grouped_mm"):
        raise NotImplementedError(
            f"experts_implementation={impl!r} on model_type={config.get('model_type')!r}: "
            "its expert buffers follow the routing (nonzero / where per expert); the derived "
            "replay models transformers' default 'grouped_mm', whose sizes do not"
        )


@lru_cache(maxsize=64)
def notes_of(config_json: str, kernel: str = "") -> tuple[str, ...]:
    """Notes a derived estimate carries beyond the derivation's, for the ``config.json`` text
    ``config_json`` (`ModelSpec.hf_config`) and the attention ``kernel`` the job asks
    (`calc.models.attention.attention_kernel`): `MOE_NOTE`, and the attention the recording
    fell back to (`attention_fallback`)."""
    config = json.loads(config_json)
    if not isinstance(config, dict):
        return ()
    out = [MOE_NOTE] if is_moe(config) else []
    if kernel:
        note = attention_fallback(config, cpu_backend(kernel))[1]
        out += [note] if note else []
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DerivedStream:
    """A fitted stream: storages with polynomial sizes, the live set at the start, the events."""

    regime: lift.Regime
    sizes: tuple[lift.Poly, ...]
    info: tuple[tuple[str, str, object], ...]
    baseline: tuple[int, ...]
    stream: tuple[tuple[bool, int, str, object], ...]
    exact: bool
    """Recorded with all the model's layers (heterogeneous layers)."""
    layout: Periodic | None = None
    """Recorded five units of a repeating pattern of layers (`calc.derive.period`)."""


def _layers_key(config: dict[str, Any]) -> str:
    for key in LAYER_KEYS:
        if key in config:
            return key
    raise NotImplementedError(f"config has none of {LAYER_KEYS}: cannot count its layers")


def heterogeneous(config: dict[str, Any]) -> bool:
    """Whether the decoder layers differ: dense layers before MoE ones
    (``first_k_dense_replace``, ``mlp_only_layers``), MoE every few layers, or per-layer kinds
    of more than one type in transformers' config object (Gemma-2/3's sliding and full
    attention, also when the config.json lists none: the config class builds them). The
    last answer is cached on disk with the config (it needs transformers)."""
    if any(config.get(key) for key in HETEROGENEOUS_KEYS):
        return True
    step = config.get("decoder_sparse_step")
    if isinstance(step, int) and step > 1:
        return True
    name = _cache_name({"schema": SCHEMA, "layer_types_of": config, **_versions()})
    cached = read_plan_cache(name)
    if cached is None:
        try:
            cached = {"kinds": sorted(set(layer_types(config)))}
        except DeriveError as exc:
            raise NotImplementedError(str(exc)) from exc
        write_plan_cache(name, cached)
    return len(cached.get("kinds", [])) > 1


def checkpoint_every(job: Training | Inference) -> int:
    """Every how many decoder layers one is checkpointed (1: all or none)."""
    return job.recompute_every if isinstance(job, Training) and job.recompute == "full" else 1


def layout_of(config: dict[str, Any], checkpoint_every: int = 1) -> Periodic | None:
    """The repeating pattern of the decoder layers of a model whose layers differ
    (`calc.derive.period.periodic_layout` of `calc.derive.record.layer_signatures`), when the
    model recorded with its prefix, five units and its tail builds exactly those layers; None
    otherwise (record every layer). ``checkpoint_every`` > 1: layers ``0, n, 2n, ...`` are
    checkpointed (``Training.recompute_every``), a difference between layers too. Cached on
    disk with the config (it needs transformers)."""
    key = {"schema": SCHEMA, "layer_layout_of": config, **_versions()}
    if checkpoint_every != 1:
        key["checkpoint_every"] = checkpoint_every
    name = _cache_name(key)
    cached = read_plan_cache(name)
    if cached is None:

        def marked(signatures: list) -> list:
            if checkpoint_every == 1:
                return signatures
            return [(sig, i % checkpoint_every == 0) for i, sig in enumerate(signatures)]

        try:
            signatures = marked(layer_signatures(config))
            layout = periodic_layout(signatures)
            if layout is not None and marked(
                layer_signatures(_traced_config(config, layout.recorded_layers))
            ) != layout.recorded_signatures(signatures):
                layout = None
        except DeriveError as exc:
            raise NotImplementedError(str(exc)) from exc
        cached = {"layout": None if layout is None else asdict(layout)}
        write_plan_cache(name, cached)
    found = cached.get("layout")
    return (
        None if not isinstance(found, dict) else Periodic(**{k: int(v) for k, v in found.items()})
    )


def thresholds(config: dict[str, Any]) -> list[int]:
    """The config's window spans (`WINDOW_KEYS`) that are positive integers."""
    return [v for key in WINDOW_KEYS if isinstance(v := config.get(key), int) and v > 0 and v != 1]


def job_values(job: Training | Inference) -> dict[str, int]:
    """The job's sizes by symbol name: ``b``, ``s`` (and ``c`` for inference)."""
    if isinstance(job, Training):
        return {"b": job.micro_batch, "s": job.seq_len}
    return {"b": job.batch, "s": job.prompt_len, "c": job.context}


def regime_of(model: ModelSpec, job: Training | Inference) -> lift.Regime:
    """The regime of ``job`` on ``model`` (part of the compile key)."""
    return _regime(job, hf_config_dict(model))


def _regime(job: Training | Inference, config: dict[str, Any]) -> lift.Regime:
    """`calc.derive.lift.regime` of the job's sizes; for ``generate``
    `calc.derive.generate.generate_regime` (the new tokens fixed)."""
    if isinstance(job, Inference) and job.new_tokens > 0:
        kept = job.output_scores or job.output_logits
        return generate.generate_regime(
            job.batch, job.prompt_len, job.new_tokens, thresholds(config), kept
        )
    if isinstance(job, Training) and job.compile != "none":
        # Inductor compiles for the shapes it is given, and its program (which buffers,
        # which fused kernels) changes with them: one recording at the job's own sizes
        return lift.Regime((), tuple(job_values(job).items()))
    return lift.regime(job_values(job), thresholds(config))


LIBRARY_IMPLEMENTATIONS = ("torchtune", "torchtitan", "litgpt")
"""Implementations that are another library's model code (`calc.models`), not transformers'."""


def check_job(model: ModelSpec, job: Training | Inference) -> None:
    """Raise ``NotImplementedError`` naming what the derived replay does not cover yet."""
    if model.derived and job.implementation == "reference":
        raise NotImplementedError(
            f"implementation='reference' is verify's own llama/gpt2 model; model_type="
            f"{model.model_type!r} runs as transformers' code (implementation='hf')"
        )
    if model.derived and job.implementation in LIBRARY_IMPLEMENTATIONS:
        raise NotImplementedError(
            f"implementation={job.implementation!r} is that library's own model code, replayed "
            f"for Llama-family configurations; model_type={model.model_type!r} is replayed "
            "from transformers' code (implementation='hf')"
        )
    parts = ("pruning", "distill", "kv_quant")
    used = [name for name in parts if getattr(job, name, None) is not None]
    if used:
        raise NotImplementedError(
            f"{', '.join(used)} on a derived architecture is not modelled yet (the derived "
            "replay records training, LoRA, weight-only quantization, QLoRA and inference)"
        )
    if isinstance(job, Training):
        check_loss_chunks(job)
        known = (None, "sgd", "sgd-momentum", "adam", "adamw", "adafactor", "lion")
        if job.optimizer not in (*known, *BNB_OPTIMIZERS):
            raise NotImplementedError(
                f"optimizer={job.optimizer!r} on a derived architecture is not modelled yet "
                "(sgd, sgd-momentum, adam, adamw, adafactor, lion, adam8bit, adam32bit are)"
            )
        if job.recompute == "selective":
            raise NotImplementedError("transformers has no selective recomputation")


def check_loss_chunks(job: Training) -> None:
    """Refuse ``loss="chunked-ce"`` with chunks that do not split the recording's samples
    evenly: its tokens are ``b x s`` with ``s`` a multiple of 64 (`calc.derive.lift.STEP`), and
    ``tensor_split`` into uneven chunks gives sizes no polynomial of ``b``, ``s`` describes.
    Refuse ``optimizer_in_backward`` where the hand graphs do too (accumulation, which
    torchtune refuses with it; the GradScaler of ``amp-fp16``)."""
    if job.optimizer_in_backward and (job.grad_accum != 1 or job.precision == "amp-fp16"):
        raise NotImplementedError(
            "optimizer_in_backward on a derived architecture is modelled with grad_accum=1 "
            "(torchtune refuses accumulation with it) and without a GradScaler (amp-fp16)"
        )
    step = lift.STEP["s"]
    if job.loss == "chunked-ce" and step % job.loss_chunks:
        raise NotImplementedError(
            f"loss_chunks={job.loss_chunks} on a derived architecture: the recording samples "
            f"sequences of multiples of {step} tokens, which {job.loss_chunks} chunks do not "
            f"split evenly; use a divisor of {step} (torchtune's default 8 is one)"
        )


def _backend(
    model: ModelSpec, job: Training | Inference, config: dict[str, Any], shard: Rank | None = None
) -> str:
    """The CPU attention path verify's hf cases take (``verify/run/step.py``, ``pins_for``),
    less what the model cannot run (`attention_fallback`); under an FSDP rank's bf16
    mixed-precision policy (``shard``) the kernel of bf16 inputs."""
    dropout = config.get("attention_dropout", 0.0) if model.derived else model.attention_dropout
    if not isinstance(job, Training) or not isinstance(dropout, int | float):
        dropout = 0.0
    mp16 = isinstance(shard, Shard) and compute_16bit_of(shard.param_itemsize)
    backend = cpu_backend(attention_kernel(model, job, mp16), float(dropout))
    return attention_fallback(config, backend)[0]


def check_cuda(model: ModelSpec, job: Training | Inference) -> None:
    """``NotImplementedError`` (or ``ValueError`` for a forced kernel) where CUDA would run
    another SDPA kernel than the recording stands for: fp32 grouped-query inference runs math on
    CUDA, its memory-efficient kernel taking no grouped key/value heads
    (`calc.models.attention.check_cuda_kernel`; measured on an H200: "No available kernel" with
    it forced), while the recording runs CPU flash. Eager and math recordings run the same path
    on CUDA."""
    config = job_config(model, job)
    backend = _backend(model, job, config)
    if backend in ("eager", "math"):
        without = attention_fallback(config, cpu_backend(attention_kernel(model, job)))[0]
        if backend == "math" and without == "flash":  # math only for the attention dropout
            dropout = config.get("attention_dropout")
            raise NotImplementedError(
                f"attention dropout {dropout} under SDPA on CUDA: CUDA keeps its fused kernel "
                "with dropout, while the recording runs the CPU's math kernel (fused CPU "
                "kernels take no dropout); use attention='eager' or device='cpu'"
            )
        return
    check_cuda_kernel(model, job)


SDPA_ABSENT_NOTE = (
    "transformers has no SDPA attention for this model class: recorded with eager attention, "
    "what transformers builds it with when none is asked for"
)
"""The note of an SDPA job on a model class without SDPA (Gemma-2)."""
MATH_FALLBACK_NOTE = (
    "CPU SDPA's flash kernel needs equal query/key and value head dims: recorded with the math "
    "kernel, CPU PyTorch's own fallback for these heads"
)
"""The note of a flash job on heads of two widths (DeepSeek's latent attention)."""


def head_dims_differ(config: dict[str, Any]) -> bool:
    """Whether the value heads are narrower or wider than the query/key heads: ``v_head_dim``
    against ``qk_nope_head_dim + qk_rope_head_dim`` (DeepSeek-V2/V3's latent attention), else
    ``head_dim``. CPU flash SDPA then has no kernel (``sdp_utils_cpp.cpp``: "Flash attention
    requires q,k,v to have the same last dimension") and PyTorch runs math."""
    v = config.get("v_head_dim")
    if not isinstance(v, int):
        return False
    nope, rope = config.get("qk_nope_head_dim"), config.get("qk_rope_head_dim")
    qk = nope + rope if isinstance(nope, int) and isinstance(rope, int) else config.get("head_dim")
    return isinstance(qk, int) and qk != v


@lru_cache(maxsize=64)
def _sdpa_supported(config_json: str) -> bool:
    try:
        return sdpa_supported(json.loads(config_json))
    except ImportError:  # without transformers nothing is recorded; its refusal says so
        return True


def attention_fallback(config: dict[str, Any], backend: str) -> tuple[str, str]:
    """(backend recorded, note) for the CPU ``backend`` asked (``flash``, ``math``, ``eager``):
    eager for a model class transformers builds without SDPA, math for flash on heads of two
    widths (`head_dims_differ`); the note says which, or is empty."""
    if backend != "eager" and not _sdpa_supported(json.dumps(config, sort_keys=True)):
        return "eager", SDPA_ABSENT_NOTE
    if backend == "flash" and head_dims_differ(config):
        return "math", MATH_FALLBACK_NOTE
    return backend, ""


def job_config(model: ModelSpec, job: Training | Inference) -> dict[str, Any]:
    """The ``config.json`` the job runs: a derived model's with ``job.dropout`` at every
    dropout key (`calc.derive.dropout`); a hand-modelled type's from its spec with the job's
    dropout (`_with_dropout`)."""
    config = hf_config_dict(_with_dropout(model, job))
    if isinstance(job, Training) and model.derived:
        return dropout_config(config, job.dropout)
    return config


def _with_dropout(model: ModelSpec, job: Training | Inference) -> ModelSpec:
    """The model as the job runs it: ``job.dropout`` at every dropout site (hand-modelled
    types; a derived one's config takes it, `job_config`)."""
    if not isinstance(job, Training) or job.dropout is None or model.derived:
        return model
    p = job.dropout
    return model.with_overrides(attention_dropout=p, hidden_dropout=p, embedding_dropout=p)


def _traced_config(config: dict[str, Any], n_layers: int) -> dict[str, Any]:
    out = dict(config)
    out[_layers_key(config)] = n_layers
    types = out.get("layer_types")
    if isinstance(types, list):
        out["layer_types"] = types[:n_layers]
    return out


def _cache_name(parts: dict[str, Any]) -> str:
    text = json.dumps(parts, sort_keys=True, default=str)
    return "derived-" + hashlib.sha256(text.encode()).hexdigest()


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def derived_stream(
    model: ModelSpec,
    job: Training | Inference,
    n_layers: int,
    shard: Rank | None = None,
    every_layer: bool = False,
) -> DerivedStream:
    """The fitted stream of ``job`` on ``model`` recorded with ``n_layers`` layers (all of them
    when the layers differ and repeat no pattern, or when ``every_layer``), on one FSDP2 rank
    when ``shard`` is given (`calc.derive.sharding`), from the disk cache when it has it."""
    check_job(model, job)
    model = _with_dropout(model, job)
    config = job_config(model, job)
    check_experts(config)
    every = checkpoint_every(job)
    if isinstance(shard, LocalOptimizer):  # ZeRO-1's partition differs from layer to layer
        every_layer = True
    if isinstance(job, Training) and job.compile != "none":
        if shard is not None and not (isinstance(shard, Shard) and shard.version == 2):
            raise NotImplementedError(
                f"compile={job.compile!r} is recorded on one process and on an FSDP2 rank; "
                "not with ZeRO-1, FSDP1 or tensor parallelism yet"
            )
        # "default": one graph of all layers, no layer's storages can be told apart;
        # "regional": which layers compile is Dynamo's call (`calc.derive.inductor`)
        every_layer = True
    differ = every != 1 or heterogeneous(config)
    layout = layout_of(config, every) if differ and not every_layer else None
    exact = every_layer or (differ and layout is None)
    layers = model.n_layers if exact else n_layers
    if layout is not None:
        layers = layout.recorded_layers
    reg = _regime(job, config)
    traced = _traced_config(config, layers)
    backend = _backend(model, job, config, shard)
    structure = {
        k: v for k, v in asdict(job).items() if k not in ("micro_batch", "seq_len", "batch")
    }
    if isinstance(job, Inference):
        structure.pop("context"), structure.pop("prompt")
        if generate.is_cut(reg):  # the regime holds the sizes (b, s, c): any new_tokens
            structure.pop("new_tokens")
    name = _cache_name(
        {"schema": SCHEMA, "config": traced, "job": structure, "kind": type(job).__name__,
         "regime": asdict(reg), "backend": backend, **_versions(),
         **({"shard": {"kind": type(shard).__name__, **asdict(shard)}} if shard else {})}
    )  # fmt: skip
    cached = read_plan_cache(name)
    if cached is not None:
        return replace(_from_json(cached, reg, exact), layout=layout)
    derived = replace(_record(traced, job, backend, reg, exact, shard), layout=layout)
    write_plan_cache(name, _to_json(derived))
    return derived


def _record(
    config: dict[str, Any],
    job: Training | Inference,
    backend: str,
    reg: lift.Regime,
    exact: bool,
    shard: Rank | None = None,
) -> DerivedStream:
    """Record at the points of the regime's plan, check one structure, fit the sizes: first
    `lift.factor_plan`'s few points; when a size is of another form, the rest of the grid."""
    count = _Count(_what(config, job))
    if not reg.free:  # every size fixed: one recording, its sizes as they are
        count.plan(1)
        with contextlib.ExitStack() as stack:
            trace = _guarded(
                config, lambda: stack.enter_context(session(config, job, backend, shard))
            )
            values = dict(reg.fixed)
            tr = _guarded(config, partial(trace, values["b"], values["s"], values.get("c", 0)))
            count.step()
        constant: tuple[lift.Poly, ...] = tuple((((), n, 1),) if n else () for n in tr.nbytes)
        return DerivedStream(reg, constant, tr.info, tr.baseline, tr.stream, exact)
    grid, held = generate.sample_plan(reg)
    generating = isinstance(job, Inference) and job.new_tokens > 0
    quick = None if generating else lift.factor_plan(reg)  # generate: the full grid, as verified
    count.plan(len(quick[0]) + 1 if quick is not None else len(grid) + 1)
    with contextlib.ExitStack() as stack:
        trace = _guarded(config, lambda: stack.enter_context(session(config, job, backend, shard)))

        def run(points: list[dict[str, int]]) -> list[Trace]:
            out = []
            for p in points:
                out.append(_guarded(config, partial(trace, p["b"], p["s"], p.get("c", 0))))
                count.step()
            return out

        done: dict[tuple, Trace] = {}
        if quick is not None:
            points = quick[0]
            ref, check = run([points[0], held])
            _same_structure(config, [points[0], held], [ref, check])
            at = [ref.nbytes]
            for p in points[1:]:  # training: the first step only, the second's sizes follow
                got = None
                if isinstance(job, Training):
                    one = _guarded(config, partial(trace, p["b"], p["s"], 0, 1))
                    got = second_step_sizes(ref, one)
                    count.step()
                if got is None:
                    count.plan(count.total + isinstance(job, Training))
                    (full,) = run([p])
                    _same_structure(config, [points[0], p], [ref, full])
                    got = full.nbytes
                at.append(got)
            fitted = lift.fit_factors(reg, points, held, at, check.nbytes)
            if fitted is not None:
                return DerivedStream(reg, tuple(fitted), ref.info, ref.baseline, ref.stream, exact)
            done = {_point_key(points[0]): ref, _point_key(held): check}
        points = [*grid, held]
        count.plan(count.done + sum(_point_key(p) not in done for p in points))
        traces = [done.get(_point_key(p)) or run([p])[0] for p in points]
    _same_structure(config, points, traces)
    first = traces[0]
    labels = [f"{name} (layer {tag}, {kind})" for kind, name, tag in first.info]
    try:
        sizes = lift.fit(
            reg, grid, held, [t.nbytes for t in traces[:-1]], traces[-1].nbytes, labels
        )
    except lift.FitError as exc:
        raise NotImplementedError(f"model_type={config.get('model_type')!r}: {exc}") from exc
    return DerivedStream(reg, tuple(sizes), first.info, first.baseline, first.stream, exact)


class _Count:
    """The runs of one recording, reported to `calc.derive.progress` as they finish."""

    def __init__(self, what: str) -> None:
        self.what, self.done, self.total = what, 0, -1

    def plan(self, total: int) -> None:
        """The recording now plans ``total`` runs in all (reported when that changes)."""
        if total != self.total:
            self.total = total
            progress.report(self.done, self.total, self.what)

    def step(self) -> None:
        """One more run recorded."""
        self.done += 1
        self.total = max(self.total, self.done)
        progress.report(self.done, self.total, self.what)


def _what(config: dict[str, Any], job: Training | Inference) -> str:
    """What a recording records, for its progress: the model type and the kind of job."""
    if isinstance(job, Training):
        kind = "training step"
    else:
        kind = "generate" if job.new_tokens > 0 else "prefill"
    return f"{config.get('model_type', 'model')} {kind}"


def _point_key(point: dict[str, int]) -> tuple:
    return tuple(sorted(point.items()))


def _guarded(config: dict[str, Any], call: Callable[[], T]) -> T:
    """``call()``, its failures as one `NotImplementedError` naming the model type."""
    try:
        return call()
    except DeriveError as exc:
        raise NotImplementedError(str(exc)) from exc
    except Exception as exc:  # the modeling code failed on fake tensors: say where, once
        raise NotImplementedError(
            f"the modeling code of model_type={config.get('model_type')!r} does not run on fake "
            f"tensors: {type(exc).__name__}: {first_sentence(str(exc))}"
        ) from exc


def _same_structure(config: dict[str, Any], points: list[dict[str, int]], traces: list) -> None:
    """Every point must record the first one's stream (the sizes aside)."""
    first = traces[0]
    for point, tr in zip(points, traces, strict=True):
        if tr.structure() != first.structure():
            raise NotImplementedError(
                f"model_type={config.get('model_type')!r}: the ops it runs change with the "
                f"sizes (at {point} against {points[0]}): the derived replay needs one "
                "code path for every size"
            )


def _to_json(d: DerivedStream) -> dict[str, Any]:
    return {
        "sizes": [[[list(m), n, q] for m, n, q in poly] for poly in d.sizes],
        "info": [list(x) for x in d.info],
        "baseline": list(d.baseline),
        "stream": [list(x) for x in d.stream],
    }


def _from_json(data: dict[str, Any], reg: lift.Regime, exact: bool) -> DerivedStream:
    """The cached stream (numbers and names only: nothing in it is evaluated)."""
    sizes = tuple(
        tuple((tuple(int(e) for e in m), int(n), int(q)) for m, n, q in poly)
        for poly in data["sizes"]
    )
    info = tuple((str(k), str(n), t) for k, n, t in data["info"])
    stream = tuple((bool(a), int(i), str(p), seg) for a, i, p, seg in data["stream"])
    return DerivedStream(reg, sizes, info, tuple(data["baseline"]), stream, exact)


@dataclass(frozen=True, slots=True)
class Recorded:
    """A derived replay's events and how its layers stand for the model's."""

    events: list[Event]
    every_layer: bool
    """Every layer was recorded: take the candidates as they are, no generalisation."""
    units: int | None = None
    """Five units of a repeating pattern were recorded (`calc.derive.period`): the model has
    this many; the timeline adds the missing middle ones (``units - 5``)."""


def derived_events(
    model: ModelSpec,
    job: Training | Inference,
    n_layers: int,
    shard: Rank | None = None,
    every_layer: bool = False,
) -> Recorded:
    """The events of ``job`` on ``model`` (one FSDP2 rank's with ``shard``): the fitted stream
    played on a tape (sizes as expressions of ``b``, ``s``, ``c``; rounded to 512 B by the
    tape); a recording of units files each layer's storages under its unit
    (`calc.derive.period.Periodic.tag`). ``every_layer``: all of the model's layers recorded,
    the stream the caching allocator's replay needs (`calc.estimate.reserved`)."""
    d = derived_stream(model, job, n_layers, shard, every_layer)
    layout = d.layout

    def tag_of(tag: object) -> object:
        return layout.tag(tag) if layout is not None and is_layer(tag) else tag

    tape = Tape(inplace_accumulate=False)
    held: dict[int, Tensor] = {}
    for sid in d.baseline:
        kind, name, tag = d.info[sid]
        held[sid] = tape.existing(
            lift.expression(d.sizes[sid], d.regime), 1, name, kind, False, tag_of(tag)
        )
    for alloc, sid, phase, segment in d.stream:
        tape.phase = phase
        tape.segment = tag_of(segment)
        if alloc:
            kind, name, tag = d.info[sid]
            held[sid] = tape.new(
                lift.expression(d.sizes[sid], d.regime), 1, name, kind, tag_of(tag)
            )
        else:
            tape.drop(held.pop(sid))
    return Recorded(tape.events, d.exact, None if layout is None else layout.units)


@lru_cache(maxsize=64)
def derived_trainable_numels(model: ModelSpec, job: Training) -> list[int]:
    """Elements of each parameter ``job`` trains on the derived ``model``
    (`calc.derive.record.trainable_numels`: transformers' model on the ``meta`` device)."""
    try:
        return trainable_numels(hf_config_dict(model), job)
    except DeriveError as exc:
        raise NotImplementedError(str(exc)) from exc


class RecorderMissing(NotImplementedError):
    """The derived replay is needed and torch or transformers is not installed (the core
    install, or the web app's, has neither); the message names what to install."""


RECORDER_PACKAGES = ("torch", "transformers")
"""What recording transformers' code needs (``vramplan[verify]`` pins both)."""


def missing_recorder() -> tuple[str, ...]:
    """The packages of `RECORDER_PACKAGES` that are not installed."""
    return tuple(name for name in RECORDER_PACKAGES if util.find_spec(name) is None)


def install_hint(missing: tuple[str, ...]) -> str:
    """What to install for the recording, ``missing`` being `missing_recorder`'s answer."""
    return f"install {' and '.join(missing)} (pip install 'vramplan[verify]')"


def require_recorder(model_type: str) -> None:
    """`RecorderMissing` naming ``model_type`` and the packages to install, when any is
    missing; nothing otherwise."""
    missing = missing_recorder()
    if missing:
        raise RecorderMissing(
            f"model_type={model_type!r} is estimated from transformers' own modeling code "
            f"(the derived replay): {install_hint(missing)}"
        )


def param_count(model: ModelSpec) -> int:
    """The model's parameter count: `ModelSpec.n_params` for the hand-modelled types; for a
    derived one, transformers' model built on the ``meta`` device (``NotImplementedError``
    with one message when transformers cannot build it, `RecorderMissing` without it)."""
    if not model.derived:
        return model.n_params
    require_recorder(model.model_type)
    try:
        return count_parameters(hf_config_dict(model))
    except DeriveError as exc:
        raise NotImplementedError(str(exc)) from exc
