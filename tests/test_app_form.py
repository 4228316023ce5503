"""The web calculator's form (webapp.form) and model source (webapp.model_source), without a
server: every job field has a widget, the URL round-trips the state, bad input is refused with a
message naming it."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import calc
from webapp import form
from webapp.model_source import MAX_CONFIG_BYTES, from_card, from_config_bytes

CARDS = tuple(calc.list_cards())
GPUS = ("h100-80gb", "a100-40gb")


@pytest.mark.parametrize("task", form.TASKS)
def test_every_job_field_has_exactly_one_widget(task: str) -> None:
    # A field another issue adds to calc.Training / calc.Inference must get a FormField
    # (webapp/form.py: PARALLELISM or COMPRESSION); this is the test that says so.
    job_fields = [f.name for f in dataclasses.fields(form.JOB_CLASS[task])]
    widget_fields = [f.name for f in form.fields_of(task)]
    assert sorted(widget_fields) == sorted(job_fields)


def test_form_defaults_build_the_documented_default_jobs() -> None:
    # README / CLI defaults: training micro-batch 1 x 2048 tokens, inference batch 1 x 4096.
    state = form.defaults()
    assert form.build_job("train", state) == calc.Training(micro_batch=1, seq_len=2048)
    assert form.build_job("infer", state) == calc.Inference(batch=1, context=4096)


def _value(field: form.FormField, draw: st.DrawFn) -> object:
    if field.kind == "choice":
        return draw(st.sampled_from(field.choices))
    if field.kind in ("int", "optional_int"):
        value = draw(st.integers(int(field.low), min(int(field.high), 1 << 16)))
    else:
        value = draw(st.sampled_from([field.low, 0.1, 0.5, field.high]))
    if field.kind.startswith("optional") and draw(st.booleans()):
        return None
    return value


@st.composite
def states(draw: st.DrawFn) -> dict:
    state = form.defaults()
    state["task"] = draw(st.sampled_from(form.TASKS))
    state["card"] = draw(st.sampled_from(CARDS))
    state["gpu"] = draw(st.sampled_from(GPUS))
    state["plan.global_batch"] = draw(st.integers(1, 4096))
    state["plan.task"] = draw(st.sampled_from(form.PLAN_TASKS))
    for field in form.fields_of(state["task"]):
        state[field.key] = _value(field, draw)
    return state


@settings(max_examples=150, deadline=None)
@given(states())
def test_url_round_trips_the_state_of_the_selected_task(state: dict) -> None:
    query = form.to_query(state)
    assert all(isinstance(v, str) for v in query.values())
    back, warnings = form.from_query(query, CARDS, GPUS)
    assert warnings == []
    keys = ["task", "card", "gpu", "plan.global_batch", "plan.task"]
    keys += [f.key for f in form.fields_of(state["task"])]
    assert {k: back[k] for k in keys} == {k: state[k] for k in keys}


def test_bad_query_values_are_ignored_with_a_warning_naming_them() -> None:
    query = {
        "task": "train",
        "card": "no-such-card",
        "gpu": "gtx-480",
        "micro_batch": "0",
        "seq_len": "1e3",
        "precision": "__import__('os')",
        "dropout": "nan",
        "global_batch": "-4",
    }
    state, warnings = form.from_query(query, CARDS, GPUS)
    text = "\n".join(warnings)
    for name in ("card", "gpu", "micro_batch", "seq_len", "precision", "dropout", "global_batch"):
        assert name in text
    assert len(warnings) == 7
    assert state == {**form.defaults(), "task": "train"}


def test_custom_config_travels_in_the_url_as_json() -> None:
    config = calc.load_card_config("gpt2")
    query = form.to_query({**form.defaults(), "source": "paste"}, config)
    assert json.loads(query["config"]) == config
    state, warnings = form.from_query(query, CARDS, GPUS)
    assert warnings == []
    assert state["source"] == "paste"
    assert from_config_bytes(state["config"]).spec == calc.ModelSpec.from_hf_config(
        config, name="custom"
    )


# ----------------------------------------------------------------------------- model source


def test_card_and_its_config_json_give_the_same_model() -> None:
    card = from_card("qwen2.5-0.5b")
    text = json.dumps(calc.load_card_config("qwen2.5-0.5b"))
    custom = from_config_bytes(text.encode())
    assert custom.spec.n_params == card.spec.n_params == calc.published_params("qwen2.5-0.5b")


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "empty"),
        (b"   \n", "empty"),
        (b"\xff\xfe{", "not UTF-8"),
        (b'{"model_type": "llama",', "malformed JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"model_type": "bert"}', "model_type"),
        (b'{"model_type": "llama"}', "hidden_size"),
        (b'{"model_type": "llama", "hidden_size": "4096"}', "hidden_size"),
        (b"[" * 100_000, "nested too deeply"),
        (b" " * (MAX_CONFIG_BYTES + 1), "limit"),
    ],
)
def test_bad_configs_are_refused_with_a_message_naming_the_problem(data: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        from_config_bytes(data)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=300), st.text(max_size=300), st.from_regex(r"\{.*\}")))
def test_arbitrary_uploads_raise_nothing_but_value_error(data: bytes | str) -> None:
    try:
        from_config_bytes(data)
    except ValueError:
        pass
