"""Where a hand-written graph refuses a Hugging Face job, the replay derived from transformers'
own code (`calc.derive`) may answer instead: `derived_fallback` says whether and with which
job, `compiled_or_derived` compiles whichever answers. Used by `calc.estimate` for one GPU and
by `calc.estimate.ranks` for each rank of a DDP/FSDP layout (FSDP1 only the recording models)."""

from __future__ import annotations

from dataclasses import replace

from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.derive.replay import check_cuda, install_hint, missing_recorder
from calc.estimate.core import SINGLE, Compiled, ReplayOptions, StructureKey, compiled_for


def derived_fallback(
    model: ModelSpec, job: Training | Inference, device: str
) -> Training | Inference | None:
    """``job`` with ``implementation="derived"`` where that replay stands in for the hf one:
    a hand-modelled type, torch and transformers installed (the recording needs them), and
    the recorded CPU kernels the ones the device runs: always on the CPU tracker; on CUDA only
    without attention dropout (CUDA keeps its fused SDPA kernels with dropout, the CPU takes the
    math kernel: `calc.models.attention`) and not for fp32 grouped-query inference (math on
    CUDA: `calc.derive.replay.check_cuda`)."""
    if job.implementation != "hf" or model.derived:
        return None
    if missing_recorder():
        return None
    if device != "cpu" and isinstance(job, Training):
        attn_dropout = job.dropout if job.dropout is not None else model.attention_dropout
        if attn_dropout > 0:
            return None
    derived = replace(job, implementation="derived")
    if device != "cpu":
        try:
            check_cuda(model, derived)
        except (NotImplementedError, ValueError):
            return None  # CUDA runs another kernel: the hand graph's refusal stands
    return derived


def recorded_only(job: Training | Inference) -> bool:
    """Whether only the recording models ``job`` (``torch.compile``, checkpointing some layers
    or by op, transformers' activation offloading): when it fails, its reason is the one to give, not the
    hand graph's."""
    if not isinstance(job, Training):
        return False
    offloads = job.offload_activations and job.implementation != "torchtune"
    by_op = job.recompute == "op"
    return job.compile != "none" or job.recompute_every != 1 or offloads or by_op


def compiled_or_derived(
    model: ModelSpec, job: Training | Inference, device: str, opts: ReplayOptions = SINGLE
) -> tuple[Compiled, StructureKey, Training | Inference, tuple[str, ...]]:
    """``(compiled, key, job, notes)`` of ``job`` replayed with ``opts``. Where the
    hand-written Hugging Face graph refuses it (eager attention under autocast, dropout,
    sampling, a loop with LoRA on a DDP rank, ...), the replay derived from transformers' own
    code answers instead when `derived_fallback` allows it and the recording covers ``opts``;
    its note names what the hand graph lacks. Otherwise the hand graph's
    ``NotImplementedError`` stands."""
    try:
        comp, key = compiled_for(model, job, device, opts)
        return comp, key, job, ()
    except NotImplementedError as hand:
        derived = derived_fallback(model, job, device)
        if derived is None:
            missing = missing_recorder() if job.implementation == "hf" else ()
            if missing and not model.derived:
                raise NotImplementedError(
                    f"{hand}; the replay recorded from transformers' code would answer it: "
                    f"{install_hint(missing)}"
                ) from None
            raise
        try:
            comp, key = compiled_for(model, derived, device, opts)
        except NotImplementedError:
            if recorded_only(job):  # the hand graph never models it: the recording's reason
                raise
            raise hand from None
        lacks = str(hand)
    note = f"derived from transformers' code: the hand-written graph does not model this ({lacks})"
    return comp, key, derived, (note,)
