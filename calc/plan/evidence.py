"""Error bars from the latest verify report: how wrong was calc on cases like this one?

``python -m verify`` writes ``verify/reports/latest/report.json``: per case the job (the fields
of ``calc.Training``/``calc.Inference``), the model (``spec``), the predicted and measured peaks
and ``error_pct``. For a job, the *nearest* verified cases are the compared cases of the same
kind (training or inference) that share the most of ``SIMILARITY_FIELDS`` with it; the error
bar is the largest absolute error among them. This module is pure: the report is read by
``calc.data.cards.load_verify_report`` and passed in.

Each bar says where its figure comes from (``source``: the CPU storage tracker, or recorded GPU
runs) and, for a CUDA estimate whose nearest cases were not measured on a GPU, which of the
configuration's terms exist only on CUDA and so are unverified (`cuda_only_terms`): modelled
from PyTorch's source, not measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec
from calc.models.attention import kernel_for

SOURCES = {"cpu": "CPU storage tracker (python -m verify)", "cuda": "recorded GPU runs"}
"""Where a verified case's measurement comes from, by its device."""

SIMILARITY_FIELDS: tuple[str, ...] = (
    "implementation",
    "precision",
    "optimizer",
    "recompute",
    "attention",
    "optimizer_impl",
    "model_type",
)
"""What makes a verified case near a job, in order of weight (earlier fields break ties)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifiedCase:
    """One compared case of a verify report."""

    name: str
    """The case's name in the report."""
    kind: str
    """``training`` or ``inference``."""
    fields: Mapping[str, object]
    """The job's fields plus ``model_type`` of the case's (scaled) model."""
    abs_error_pct: float
    """``|predicted - measured| / measured`` in percent."""
    device: str
    """``cpu`` (storage tracker) or ``cuda``: what was measured."""


def verified_cases(report: Mapping | None) -> tuple[VerifiedCase, ...]:
    """The compared cases of a parsed report (cases without an error, e.g. not modelled, are
    left out); ``()`` for ``None`` or a report without cases."""
    if not isinstance(report, Mapping):
        return ()
    out = []
    for case in report.get("cases", ()):
        if not isinstance(case, Mapping):
            continue
        err = case.get("error_pct")
        job = case.get("job")
        if (
            isinstance(err, bool)
            or not isinstance(err, int | float)
            or not isinstance(job, Mapping)
        ):
            continue
        spec = case.get("spec")
        if not isinstance(spec, Mapping):
            spec = {}
        fields = {**job, "model_type": spec.get("model_type")}
        out.append(
            VerifiedCase(
                name=str(case.get("name", "?")),
                kind=str(case.get("kind", "")),
                fields=fields,
                abs_error_pct=abs(float(err)),
                device=str(case.get("device", "?")),
            )
        )
    return tuple(out)


def nearest_cases(
    job: Training | Inference, model: ModelSpec | None, cases: Sequence[VerifiedCase]
) -> tuple[tuple[VerifiedCase, ...], tuple[str, ...]]:
    """The cases sharing the most ``SIMILARITY_FIELDS`` with ``job`` (and the model's type),
    and the names of the fields they share; ``((), ())`` when no case is of the job's kind."""
    kind = "training" if isinstance(job, Training) else "inference"
    mine = {f: getattr(job, f, None) for f in SIMILARITY_FIELDS}
    mine["model_type"] = model.model_type if model is not None else None
    best: list[VerifiedCase] = []
    best_key: tuple = ()
    for case in cases:
        if case.kind != kind:
            continue
        key = tuple(
            mine[f] is not None and case.fields.get(f) == mine[f] for f in SIMILARITY_FIELDS
        )
        score = (sum(key), key)
        if not best or score > best_key:
            best, best_key = [case], score
        elif score == best_key:
            best.append(case)
    if not best:
        return (), ()
    shared = tuple(f for f, same in zip(SIMILARITY_FIELDS, best_key[1], strict=True) if same)
    return tuple(best), shared


@dataclass(frozen=True, kw_only=True, slots=True)
class ErrorBar:
    """The error ``python -m verify`` observed on the verified cases nearest to a config."""

    max_abs_error_pct: float
    """Largest absolute relative error (%) of the peak over those cases."""
    cases: tuple[str, ...]
    """Names of the verify cases used (``verify/reports/latest/report.json``)."""
    similarity: str
    """What the cases share with the config (``implementation=hf, precision=bf16-master,
    ...``)."""
    measured_on: str
    """What the cases measured (``cpu``: verify's CPU storage tracker; ``cuda``), so the
    reader knows which terms the evidence covers (the CPU tracker does not see CUDA-only
    terms such as cuBLAS workspaces)."""
    source: str = ""
    """Where the figure comes from, in words (``SOURCES``)."""
    unverified: tuple[str, ...] = ()
    """The configuration's CUDA-only terms no measurement covers (`cuda_only_terms`), when the
    estimate is for CUDA and its nearest cases were not measured on a GPU."""

    def text(self) -> str:
        """``verified error on similar cases ≤1.2% (3 cases, cpu tracker)``, then the
        unverified CUDA-only terms when there are any."""
        n = len(self.cases)
        where = "cpu tracker" if self.measured_on == "cpu" else self.measured_on
        text = (
            f"verified error on similar cases ≤{self.max_abs_error_pct:.1f}% "
            f"({n} case{'s' if n != 1 else ''}, {where})"
        )
        if self.unverified:
            text += f"; unverified CUDA-only terms: {', '.join(self.unverified)}"
        return text


def cuda_only_terms(job: Training | Inference, model: ModelSpec | None) -> tuple[str, ...]:
    """The terms of ``job`` on CUDA that the CPU tracker cannot see (docs/verification.md):
    always the cuBLAS workspaces (and, asked for, the allocator's reserved memory); the SDPA
    kernel when CUDA picks another than the CPU run; the CUDA flash kernel's own tensors;
    1-byte dropout masks; autocast's CUDA fp32 ops in the GPT-2 graph."""
    terms = ["cuBLAS workspaces"]
    dropout = 0.0
    if isinstance(job, Training):
        p = job.dropout
        dropout = p if p is not None else (model.attention_dropout if model is not None else 0.0)
    if model is not None and job.attention != "eager":
        cuda = kernel_for(model, job, "cuda", dropout)
        if cuda != kernel_for(model, job, "cpu", dropout):
            terms.append(f"SDPA kernel ({cuda} on CUDA)")
        if cuda == "flash":
            terms.append("flash kernel tensors")
    if dropout > 0:
        terms.append("dropout masks")
    amp = job.precision.startswith("amp-")
    if amp and model is not None and model.model_type == "gpt2":
        terms.append("autocast fp32 ops")
    return tuple(terms)


def error_bar(
    job: Training | Inference,
    model: ModelSpec | None,
    cases: Sequence[VerifiedCase],
    device: str = "cuda",
) -> ErrorBar | None:
    """The error bar of ``job`` on ``device``: the largest error over the nearest verified
    cases (``nearest_cases``; ``cases`` from
    ``verified_cases(calc.data.cards.load_verify_report())``), with its source and, for CUDA,
    the CUDA-only terms no GPU measurement among them covers; None when no compared case is of
    the job's kind."""
    near, shared = nearest_cases(job, model, cases)
    if not near:
        return None
    mine = {f: getattr(job, f, None) for f in SIMILARITY_FIELDS}
    mine["model_type"] = model.model_type if model is not None else None
    devices = sorted({c.device for c in near})
    gpu_measured = "cuda" in devices
    return ErrorBar(
        max_abs_error_pct=max(c.abs_error_pct for c in near),
        cases=tuple(c.name for c in near),
        similarity=", ".join(f"{f}={mine[f]}" for f in shared) or "same kind of job",
        measured_on=", ".join(devices),
        source="; ".join(SOURCES.get(d, d) for d in devices),
        unverified=cuda_only_terms(job, model) if device == "cuda" and not gpu_measured else (),
    )
