"""Every input of the web calculator in one table: widget key, URL query parameter, allowed values.

A job field (a field of ``calc.Training`` or ``calc.Inference``) is one ``FormField``; the page
draws a widget per entry and builds the job from the values, so an option that another issue
adds to the job classes needs one entry here (``PARALLELISM`` for dp/tp/pp/ZeRO/offload,
``COMPRESSION`` for LoRA/QLoRA/quantisation) and nothing else. ``tests/test_app_form.py`` fails
while a job field has no entry.

The state of the page is a flat ``dict`` keyed by widget key; ``to_query`` and ``from_query``
turn it into the URL query string and back (every value parsed and validated, never evaluated),
so a result can be shared by link.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import calc
from calc import jobs, plan
from calc.plan_axes import AXES

Kind = Literal["choice", "int", "float", "optional_int", "optional_float"]
TASKS: tuple[str, ...] = ("train", "infer")
TASK_LABELS: dict[str, str] = {"train": "training step", "infer": "inference prefill"}
JOB_CLASS: dict[str, type] = {"train": calc.Training, "infer": calc.Inference}
SOURCES: tuple[str, ...] = ("card", "paste", "upload")
SOURCE_LABELS: dict[str, str] = {
    "card": "model card",
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
    the job class's default, None, applies)."""
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
              default=_default(T, "optimizer"), choices=jobs.OPTIMIZERS),
    FormField(task="train", name="recompute", label="recompute", kind="choice",
              default=_default(T, "recompute"), choices=jobs.RECOMPUTES,
              help="activation recomputation: selective = attention core, full = every layer"),
    FormField(task="train", name="attention", label="attention", kind="choice",
              default=_default(T, "attention"), choices=jobs.ATTENTIONS,
              help="sdpa = the kernel CUDA picks; or force a kernel; eager = softmax written out"),
    FormField(task="train", name="optimizer_impl", label="optimizer implementation",
              kind="choice", default=_default(T, "optimizer_impl"),
              choices=jobs.OPTIMIZER_IMPLS, section="advanced"),
    FormField(task="train", name="implementation", label="modeling code", kind="choice",
              default=_default(T, "implementation"), choices=jobs.IMPLEMENTATIONS,
              section="advanced", help="hf = Hugging Face transformers; reference = verify's"),
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
)  # fmt: skip

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
              default=_default(I, "implementation"), choices=jobs.IMPLEMENTATIONS,
              section="advanced"),
)  # fmt: skip

PARALLELISM: tuple[FormField, ...] = ()
"""Issue 4 (dp / tp / pp / ZeRO stage / offload): one ``FormField(section="parallelism")`` per
new job field; the sidebar shows the section as soon as it has an entry."""

COMPRESSION: tuple[FormField, ...] = ()
"""Issue 5 (LoRA / QLoRA / quantisation): one ``FormField(section="compression")`` per new job
field."""

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
"""Axes the planner may enumerate besides the micro-batch (``calc.plan_axes``: enumerated by
default, not a size; an axis another issue registers there appears here); the others hold the
sidebar job's value. Fewer axes, fewer structures to compile on first use (~1.6 s each)."""
MAX_GPU_COUNT = 4096


def fields_of(task: str) -> tuple[FormField, ...]:
    """The form fields of one task, in display order."""
    return tuple(f for f in FIELDS if f.task == task)


def defaults() -> dict[str, object]:
    """The state of a fresh page: every widget key at its default."""
    return {**PAGE_DEFAULTS, **{f.key: f.default for f in FIELDS}}


def build_job(task: str, state: Mapping[str, object]) -> calc.Training | calc.Inference:
    """The ``calc.Training`` or ``calc.Inference`` the state describes (the job class validates
    every field and raises ``ValueError`` naming it)."""
    jobs.check_choice("task", task, TASKS)
    kwargs = {f.name: state.get(f.key, f.default) for f in fields_of(task)}
    return JOB_CLASS[task](**kwargs)


# ----------------------------------------------------------------------------- URL


def parse_value(field: FormField, text: str) -> object:
    """A query-string value as the field's type; ``ValueError`` naming the field and what is
    allowed. Numbers are parsed with ``int``/``float``, never evaluated."""
    text = text.strip()
    if field.kind == "choice":
        jobs.check_choice(field.name, text, field.choices)
        return text
    if field.kind.startswith("optional") and text in ("", "none", "None"):
        return None
    is_int = field.kind in ("int", "optional_int")
    try:
        value: float = int(text) if is_int else float(text)
    except ValueError:
        kind = "an integer" if is_int else "a number"
        raise ValueError(
            f"{field.name}={text!r} must be {kind} in [{field.low:g}, {field.high:g}]"
        ) from None
    if not (math.isfinite(value) and field.low <= value <= field.high):
        raise ValueError(
            f"{field.name}={text!r} is out of range: allowed [{field.low:g}, {field.high:g}]"
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


def from_query(
    params: Mapping[str, object], cards: tuple[str, ...], gpus: tuple[str, ...]
) -> tuple[dict[str, object], list[str]]:
    """The page state a URL's query parameters describe, and one warning per parameter that was
    ignored (unknown value, out of range). Missing parameters take their defaults."""
    state = defaults()
    warnings: list[str] = []
    get = {k: _first(v) for k, v in params.items()}
    task = get.get("task", "train")
    if task not in TASKS:
        warnings.append(f"task={task!r} is not one of {TASKS}: using 'train'")
        task = "train"
    state["task"] = task
    if "card" in get:
        card = get["card"].strip().lower()
        if card in cards:
            state["card"] = card
        else:
            warnings.append(f"card={get['card']!r} is not a known model card")
    if "gpu" in get:
        if get["gpu"] in gpus:
            state["gpu"] = get["gpu"]
        else:
            warnings.append(f"gpu={get['gpu']!r} is not in the GPU catalog")
    if "device" in get:
        if get["device"] in jobs.DEVICES:
            state["device"] = get["device"]
        else:
            warnings.append(f"device={get['device']!r} is not one of {jobs.DEVICES}")
    if "config" in get:
        state["source"] = "paste"
        state["config"] = get["config"]
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
    if isinstance(value, float):
        return repr(value)
    return str(value)


def to_query(state: Mapping[str, object], config: Mapping[str, object] | None = None) -> dict:
    """The query parameters of a shareable link: the task, the model (card id, or a custom
    config as minified JSON when it is short enough), the GPU, and the job fields of the
    selected task that differ from their defaults."""
    task = str(state.get("task", "train"))
    out: dict[str, str] = {"task": task}
    if state.get("source", "card") == "card" or config is None:
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
