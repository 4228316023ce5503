"""``calc.estimate``: the public entry point. Validates its input, then evaluates the compiled
replay of one GPU (`calc.estimate.core`) or of the most-loaded rank of a parallel layout
(`calc.estimate.ranks`)."""

from __future__ import annotations

from calc.compress.lora import check_parallel
from calc.compress.quant import check_fits
from calc.config.jobs import DEVICES, Inference, Training, check_choice
from calc.config.model_spec import ModelSpec
from calc.config.parallelism import Parallelism
from calc.estimate.core import compiled_for, evaluate
from calc.estimate.ranks import estimate_parallel
from calc.estimate.result import Estimate


def estimate(
    model: ModelSpec,
    job: Training | Inference,
    parallel: Parallelism | None = None,
    device: str = "cuda",
) -> Estimate:
    """Peak bytes of ``job`` on one GPU (``device="cuda"``: ``max_memory_allocated``) or under
    verify's CPU storage tracker (``device="cpu"``), with the phases and the breakdown.

    With ``parallel`` (a `calc.Parallelism` over several GPUs), the estimate is the most-loaded
    rank's (``Estimate.rank``), with every rank's peak in ``Estimate.rank_peaks`` and
    ``ranks/<r>`` keys in the breakdown (`calc.estimate.ranks`).

    Raises ``ValueError`` for invalid input and ``NotImplementedError`` for a combination the
    cost model does not cover yet (the message names it).
    """
    check_choice("device", device, DEVICES)
    if not isinstance(model, ModelSpec):
        raise ValueError(f"model must be a calc.ModelSpec, got {type(model).__name__}")
    if not isinstance(job, Training | Inference):
        raise ValueError(f"job must be calc.Training or calc.Inference, got {type(job).__name__}")
    if parallel is not None and not isinstance(parallel, Parallelism):
        raise ValueError(f"parallel must be a calc.Parallelism, got {type(parallel).__name__}")
    if isinstance(job, Training) and job.pruning is not None:
        job.pruning.modules_for(model)  # ValueError for a module the model lacks
    if isinstance(job, Training) and job.distill is not None:
        job.distill.check_student(model)
    if isinstance(job, Training) and job.loss == "chunked-ce":
        tokens = job.micro_batch * job.seq_len
        if tokens % job.loss_chunks:  # calc.models.head: equal chunks of the flattened tokens
            raise ValueError(
                f"loss_chunks={job.loss_chunks} must divide micro_batch * seq_len = {tokens}"
            )
    if job.quant is not None:  # the group size must divide every quantized linear
        check_fits(model, job.quant)
    compressed = isinstance(job, Training) and any(
        x is not None for x in (job.lora, job.quant, job.pruning, job.distill)
    )
    if parallel is not None and not parallel.is_single and compressed:
        check_parallel(job, parallel)  # NotImplementedError for the layouts not covered
    if parallel is not None and not parallel.is_single:
        return estimate_parallel(model, job, parallel, device)
    comp, key = compiled_for(model, job, device)
    return evaluate(comp, key, model, job, device)
