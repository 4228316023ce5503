"""The sidebar of the web calculator: one widget per input of ``webapp.form``, stable keys, the
state mirrored into the URL query string.

Streamlit forgets the value of a widget that is not drawn in a run (a training field while
the task is inference). The page state therefore lives in ``st.session_state["state"]`` (a plain
dict keyed by widget key): each widget is seeded from it and writes back to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import streamlit as st

import calc
from calc.data import gpus
from webapp import form
from webapp.model_source import Model, from_card, from_config_bytes, from_hub

STATE = "state"
"""Session-state key of the page state (a dict keyed by widget key)."""
INPUTS = "inputs"
"""Session-state key where the entry page leaves the resolved ``Inputs`` for the pages."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Inputs:
    """Everything the pages need, resolved and validated."""

    model: Model | None
    """The model; None when the user's config is missing or invalid (see ``errors``)."""
    job: calc.Training | calc.Inference | None
    """The job; None when a field is invalid (see ``errors``)."""
    parallel: calc.Parallelism | None
    """The parallel layout (training); None for one GPU or when a field is invalid."""
    task: str
    """``train`` or ``infer``."""
    gpu: gpus.GPU
    """The GPU the verdict is against."""
    device: str
    """``cuda`` (predict max_memory_allocated) or ``cpu`` (the CPU tracker)."""
    state: dict
    """The page state (for keys a page adds, e.g. the planner's)."""
    errors: tuple[str, ...]
    """Messages for the user: why there is no model or no job."""


@st.cache_resource
def gpu_catalog() -> dict[str, gpus.GPU]:
    """The GPU catalog (read once per server)."""
    return gpus.gpu_catalog()


@st.cache_resource
def card_ids() -> tuple[str, ...]:
    """The model card ids (read once per server)."""
    return tuple(calc.list_cards())


@st.cache_resource(max_entries=64)
def card_model(card_id: str) -> Model:
    """A model card, parsed once per server."""
    return from_card(card_id)


@st.cache_resource(max_entries=64, ttl=600, show_spinner="reading config.json from the Hub...")
def hub_model(repo_id: str) -> Model:
    """A model by Hugging Face id, asked of the Hub at most once per 10 minutes (every rerun
    would ask otherwise); a refusal is not cached."""
    return from_hub(repo_id)


def _hub_input(state: dict) -> tuple[Model | None, list[str]]:
    st.text_input(
        "Hugging Face id",
        key="hf_id",
        placeholder="Qwen/Qwen3-32B",
        help="ORG/NAME of a model on the Hugging Face Hub: its config.json only, through "
        "huggingface_hub's local cache (offline: the cached copy)",
    )
    state["hf_id"] = st.session_state["hf_id"]
    repo_id = str(state["hf_id"]).strip()
    if not repo_id:
        return None, ["type a Hugging Face model id, e.g. Qwen/Qwen3-32B"]
    try:
        model = hub_model(repo_id)
    except ValueError as exc:
        return None, [str(exc)]
    if model.notice:
        st.info(model.notice, icon=":material/cloud_off:")
    return model, []


def _default_gpu(catalog: dict[str, gpus.GPU]) -> str:
    return gpus.DEFAULT_GPU if gpus.DEFAULT_GPU in catalog else next(iter(catalog))


TUPLE_KEYS: frozenset[str] = frozenset(
    k for k, v in form.defaults().items() if isinstance(v, tuple)
)
"""State keys whose values are tuples (the form's multiselects): a list from the widget would
compare unequal to the default and open its section's expander after any change."""


def page_state() -> dict:
    """The page state, created from the URL's query parameters on the session's first run."""
    if STATE not in st.session_state:
        catalog = gpu_catalog()
        state, warnings = form.from_query(st.query_params.to_dict(), card_ids(), tuple(catalog))
        if not state["gpu"]:
            state["gpu"] = _default_gpu(catalog)
        st.session_state[STATE] = state
        st.session_state["url_warnings"] = warnings
    state = st.session_state[STATE]
    for key in state:  # widgets drawn by a page (the planner's) changed since the last run
        if key in st.session_state:
            value = st.session_state[key]  # a multiselect gives a list where the form keeps a
            state[key] = tuple(value) if key in TUPLE_KEYS else value  # tuple (its default's type)
    return state


def bind(key: str, state: dict) -> None:
    """Seed widget ``key`` from the page state before it is drawn."""
    if key not in st.session_state:
        st.session_state[key] = state[key]


def _field_widget(field: form.FormField, state: dict) -> None:
    key = field.key
    bind(key, state)
    switch = f"{field.task}.{field.needs}" if field.needs else ""
    disabled = bool(switch) and state.get(switch) in (None, form.NONE)
    if field.kind == "choice":
        st.selectbox(
            field.label, field.choices, key=key, help=field.help or None, disabled=disabled
        )
    elif field.kind == "bool":
        st.checkbox(field.label, key=key, help=field.help or None, disabled=disabled)
    elif field.kind == "multi":
        if isinstance(st.session_state[key], tuple):
            st.session_state[key] = list(st.session_state[key])
        st.multiselect(
            field.label, field.choices, key=key, help=field.help or None, disabled=disabled
        )
        state[key] = tuple(c for c in field.choices if c in st.session_state[key])
        return
    elif field.kind in ("int", "optional_int"):
        st.number_input(
            field.label,
            min_value=int(field.low),
            max_value=int(field.high),
            step=1,
            key=key,
            help=field.help or None,
            disabled=disabled,
            **({"value": None} if field.kind == "optional_int" else {}),
        )
    else:
        st.number_input(
            field.label,
            min_value=float(field.low),
            max_value=float(field.high),
            step=0.01,
            format="%.3f",
            key=key,
            help=field.help or None,
            disabled=disabled,
            **({"value": None} if field.kind == "optional_float" else {}),
        )
    state[key] = st.session_state[key]


def _radio(
    label: str, options: tuple[str, ...], key: str, labels: Mapping[str, str], state: dict
) -> None:
    """A horizontal radio of ``options`` shown by their ``labels``, mirrored into ``state``."""
    st.radio(label, options, key=key, format_func=labels.__getitem__, horizontal=True)
    state[key] = st.session_state[key]


def _model_inputs(state: dict) -> tuple[Model | None, list[str]]:
    for key in ("source", "card", "config", "hf_id"):
        bind(key, state)
    _radio("model from", form.SOURCES, "source", form.SOURCE_LABELS, state)
    errors: list[str] = []
    if state["source"] == "card":
        st.selectbox("model card", card_ids(), key="card")
        state["card"] = st.session_state["card"]
        try:  # a card of an architecture calc does not read yet
            return card_model(state["card"]), errors
        except ValueError as exc:
            return None, [str(exc)]
    if state["source"] == "hub":
        return _hub_input(state)
    if state["source"] == "paste":
        st.text_area(
            "config.json",
            key="config",
            height=160,
            max_chars=form.MAX_URL_CONFIG_CHARS * 64,
            placeholder='{"model_type": "llama", "hidden_size": 4096, ...}',
            help="a Hugging Face config.json; read as JSON, never executed",
        )
        state["config"] = st.session_state["config"]
        text = state["config"]
        if not text.strip():
            return None, ["paste a config.json (model_type llama, mistral, qwen2, qwen3 or gpt2)"]
        data: bytes | str = text
        name = "pasted config.json"
    else:
        upload = st.file_uploader("config.json", type=["json"], key="config_file")
        if upload is None:
            return None, ["upload a config.json (model_type llama, mistral, qwen2, qwen3 or gpt2)"]
        data, name = upload.getvalue(), upload.name
    try:
        return from_config_bytes(data, name=name), errors
    except ValueError as exc:
        return None, [str(exc)]


def sidebar() -> Inputs:
    """Draw every input in the sidebar, mirror the state into the URL, return the inputs."""
    state = page_state()
    catalog = gpu_catalog()
    with st.sidebar:
        for warning in st.session_state.pop("url_warnings", []):  # shown once
            st.warning(f"link: {warning}", icon=":material/warning:")
        model, errors = _model_inputs(state)
        if model is not None and model.left_out:
            st.info(model.left_out, icon=":material/image:")
        for key in ("task", "gpu"):
            bind(key, state)
        _radio("task", form.TASKS, "task", form.TASK_LABELS, state)
        st.selectbox(
            "GPU",
            tuple(catalog),
            key="gpu",
            format_func=lambda g: f"{catalog[g].name} ({catalog[g].usable_gib:.1f} GiB usable)",
        )
        state["gpu"] = st.session_state["gpu"]
        task = state["task"]
        fields = form.fields_of(task)
        for section in form.SECTIONS:
            in_section = [f for f in fields if f.section == section]
            if not in_section:
                continue
            if section == "job":
                for field in in_section:
                    _field_widget(field, state)
            else:
                changed = any(state.get(f.key, f.default) != f.default for f in in_section)
                with st.expander(section, expanded=changed and section != "advanced"):
                    for field in in_section:
                        _field_widget(field, state)
                    if section == "advanced":
                        bind("device", state)
                        st.radio(
                            "predict",
                            calc.config.jobs.DEVICES,
                            key="device",
                            horizontal=True,
                            help="cuda: torch.cuda.max_memory_allocated; "
                            "cpu: what verify's CPU storage tracker measures",
                        )
                        state["device"] = st.session_state["device"]
    job = parallel = None
    try:
        job = form.build_job(task, state)
        parallel = form.build_parallel(task, state)
    except ValueError as exc:
        errors.append(str(exc))
        job = None
    st.query_params.from_dict(form.to_query(state, model.config if model else None))
    inputs = Inputs(
        model=model,
        job=job,
        parallel=parallel,
        task=task,
        gpu=catalog[state["gpu"]],
        device=state["device"],
        state=state,
        errors=tuple(errors),
    )
    st.session_state[INPUTS] = inputs
    return inputs
