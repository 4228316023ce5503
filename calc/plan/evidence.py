"""Error bars from the latest verify report: how wrong was calc on cases like this one?

``python -m verify`` writes ``verify/reports/latest/report.json``: per case the job (the fields
of ``calc.Training``/``calc.Inference``), the model (``spec``), the predicted and measured peaks
and ``error_pct``. For a job, the *nearest* verified cases are the compared cases of the same
kind (training or inference) that share the most of ``SIMILARITY_FIELDS`` with it; the error
bar is the largest absolute error among them. This module is pure: the report is read by
``calc.data.cards.load_verify_report`` and passed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec

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

    def text(self) -> str:
        """``verified error on similar cases ≤1.2% (3 cases, cpu tracker)``."""
        n = len(self.cases)
        where = "cpu tracker" if self.measured_on == "cpu" else self.measured_on
        return (
            f"verified error on similar cases ≤{self.max_abs_error_pct:.1f}% "
            f"({n} case{'s' if n != 1 else ''}, {where})"
        )


def error_bar(
    job: Training | Inference, model: ModelSpec | None, cases: Sequence[VerifiedCase]
) -> ErrorBar | None:
    """The error bar of ``job``: the largest error over the nearest verified cases
    (``nearest_cases``; ``cases`` from ``verified_cases(calc.data.cards.load_verify_report())``);
    None when no compared case is of the job's kind."""
    near, shared = nearest_cases(job, model, cases)
    if not near:
        return None
    mine = {f: getattr(job, f, None) for f in SIMILARITY_FIELDS}
    mine["model_type"] = model.model_type if model is not None else None
    return ErrorBar(
        max_abs_error_pct=max(c.abs_error_pct for c in near),
        cases=tuple(c.name for c in near),
        similarity=", ".join(f"{f}={mine[f]}" for f in shared) or "same kind of job",
        measured_on=", ".join(sorted({c.device for c in near})),
    )
