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
def test_every_job_field_is_covered_by_the_form(task: str) -> None:
    # A field another issue adds to calc.Training / calc.Inference must get a widget: a scalar
    # field exactly one FormField of its name, an object-valued field (LoRA, Quant, ...) flat
    # options (`of`) and a builder. Nothing in the form targets a field the job lacks.
    job_fields = {f.name for f in dataclasses.fields(form.JOB_CLASS[task])}
    options = [f for f in form.fields_of(task) if f.of != "parallel"]
    assert {f.target for f in options} == job_fields
    scalar = [f.name for f in options if not f.of]
    assert len(scalar) == len(set(scalar))
    for name in {f.of for f in options if f.of}:
        assert name not in scalar
        assert name in form.OBJECT_BUILDERS
    names = [f.name for f in form.fields_of(task)]
    assert len(names) == len(set(names)), "one URL parameter per option"
    for f in form.fields_of(task):
        if f.needs:
            assert f.needs in names and f.needs != f.name


def test_every_parallelism_field_has_one_training_widget() -> None:
    fields = [f for f in form.FIELDS if f.of == "parallel"]
    assert sorted(f.name for f in fields) == sorted(
        f.name for f in dataclasses.fields(calc.Parallelism)
    )
    assert {f.task for f in fields} == {"train"}
    assert {f.section for f in fields} == {"parallelism"}
    for f in fields:  # the widget's default is the class's: untouched means one GPU
        assert f.default == next(
            g.default for g in dataclasses.fields(calc.Parallelism) if g.name == f.name
        )


def test_form_defaults_build_the_documented_default_jobs() -> None:
    # README / CLI defaults: training micro-batch 1 x 2048 tokens, inference batch 1 x 4096.
    state = form.defaults()
    assert form.build_job("train", state) == calc.Training(micro_batch=1, seq_len=2048)
    assert form.build_job("infer", state) == calc.Inference(batch=1, context=4096)


def _value(field: form.FormField, draw: st.DrawFn) -> object:
    if field.kind == "choice":
        return draw(st.sampled_from(field.choices))
    if field.kind == "bool":
        return draw(st.booleans())
    if field.kind == "multi":
        chosen = draw(st.sets(st.sampled_from(field.choices)))
        return tuple(c for c in field.choices if c in chosen)
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


def test_bad_option_values_in_the_url_are_ignored_with_a_warning_naming_them() -> None:
    query = {"lora_rank": "0", "lora_modules": "q,qq", "quant": "int3", "group_size": "1e2",
             "double_quant": "yes", "teacher": "../../etc/passwd", "dp": "-1", "zero": "4",
             "pp_schedule": "zigzag", "sp": "1"}  # fmt: skip
    state, warnings = form.from_query(query, CARDS, GPUS)
    for name in query:
        assert any(w.startswith(name + "=") for w in warnings), name
    assert len(warnings) == len(query)
    assert state == {**form.defaults(), "task": "train"}


def _state(task: str, **options: object) -> dict:
    return {**form.defaults(), **{f"{task}.{k}": v for k, v in options.items()}}


def test_flat_options_build_the_objects_written_out_here() -> None:
    state = _state("train", lora_rank=8, lora_modules=("q", "v"), quant="int4", group_size=64,
                   zero_point="no", scale_dtype="bf16", prune="unstructured", prune_amount=0.25,
                   teacher="gpt2", teacher_quant="nf4", distill_temperature=2.0)  # fmt: skip
    assert form.build_job("train", state) == calc.Training(
        micro_batch=1,
        seq_len=2048,
        lora=calc.LoRA(rank=8, modules=("q", "v")),
        quant=calc.Quant(method="int4", group_size=64, zero_point=False, scale_dtype="bf16"),
        pruning=calc.Pruning(kind="unstructured", amount=0.25),
        distill=calc.Distill(
            teacher=calc.load_card("gpt2"), teacher_quant=calc.Quant(method="nf4"), temperature=2.0
        ),
    )
    state = _state("infer", quant="fp8", fp8_scaling="row", kv_quant="fp8")
    assert form.build_job("infer", state) == calc.Inference(
        batch=1, context=4096, quant=calc.Quant(method="fp8", fp8_scaling="row"), kv_quant="fp8"
    )


def test_new_tokens_make_a_generate_job() -> None:
    # the context widget (4096) gives way to prompt + new tokens; the cache applies only then
    state = _state("infer", prompt=100, new_tokens=20, cache="static")
    assert form.build_job("infer", state) == calc.Inference(
        batch=1, prompt=100, new_tokens=20, cache="static"
    )
    state = _state("infer", prompt=100, cache="static")
    assert form.build_job("infer", state) == calc.Inference(batch=1, context=4096, prompt=100)
    # the prefill alone returns no sequences: a value left in the widget changes nothing
    state = _state("infer", prompt=100, num_return_sequences=3)
    assert form.build_job("infer", state) == calc.Inference(batch=1, context=4096, prompt=100)


def test_options_of_a_switched_off_object_are_ignored() -> None:
    # the widgets are disabled while their switch is off; a value left in them changes nothing
    state = _state("train", group_size=128, scale_dtype="fp16", lora_alpha=4.0,
                   prune_removed=True, teacher_precision="fp32")  # fmt: skip
    assert form.build_job("train", state) == calc.Training(micro_batch=1, seq_len=2048)


def test_a_link_and_the_command_line_mean_the_same_job() -> None:
    from calc.cli import main as cli

    argv = ["--precision", "bf16", "--lora-rank", "16", "--lora-alpha", "32",
            "--lora-modules", "q,k,v", "--quant", "nf4", "--group-size", "128",
            "--no-double-quant"]  # fmt: skip
    expected = cli.build_job(cli.build_parser().parse_args(argv))
    state = _state("train", precision="bf16", lora_rank=16, lora_alpha=32.0,
                   lora_modules=("q", "k", "v"), quant="nf4", group_size=128,
                   double_quant=False)  # fmt: skip
    assert form.build_job("train", state) == expected
    argv = ["--dp", "4", "--zero", "2", "--tp", "2", "--sp", "--offload", "optimizer"]
    expected_par = cli.build_parallel(cli.build_parser().parse_args(argv))
    state = _state("train", dp=4, zero=2, tp=2, sp=True, offload="optimizer")
    assert form.build_parallel("train", state) == expected_par
    assert form.build_parallel("infer", state) is None
    assert form.build_parallel("train", form.defaults()) is None


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"sp": True}, "sp=True needs tp > 1"),
        ({"fsdp": True, "zero": 2}, "zero=2 with fsdp=True"),
        ({"pp_virtual_stages": 2}, "pp_virtual_stages=2 needs"),
    ],
)
def test_bad_layouts_are_refused_naming_the_field(options: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        form.build_parallel("train", _state("train", **options))


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


def test_hugging_face_id_travels_in_the_url() -> None:
    state = {**form.defaults(), "source": "hub", "hf_id": " Qwen/Qwen3-32B "}
    query = form.to_query(state, {"model_type": "qwen3"})  # the id, not its config, is linked
    assert query["model"] == "Qwen/Qwen3-32B"
    assert "config" not in query and "card" not in query
    back, warnings = form.from_query(query, CARDS, GPUS)
    assert warnings == []
    assert (back["source"], back["hf_id"]) == ("hub", "Qwen/Qwen3-32B")


# ----------------------------------------------------------------------------- model source


def test_card_and_its_config_json_give_the_same_model() -> None:
    card = from_card("qwen2.5-0.5b")
    text = json.dumps(calc.load_card_config("qwen2.5-0.5b"))
    custom = from_config_bytes(text.encode())
    assert custom.spec.n_params == card.spec.n_params == calc.published_params("qwen2.5-0.5b")
    assert custom.left_out is None


def test_a_multimodal_config_is_its_language_model_with_what_is_left_out() -> None:
    text = calc.load_card_config("qwen2.5-0.5b")
    composite = {"model_type": "qwen2_5_vl", "text_config": text, "vision_config": {"depth": 32}}
    custom = from_config_bytes(json.dumps(composite))
    assert custom.spec.n_params == calc.published_params("qwen2.5-0.5b")
    assert custom.left_out is not None and "vision_config" in custom.left_out


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "empty"),
        (b"   \n", "empty"),
        (b"\xff\xfe{", "not UTF-8"),
        (b'{"model_type": "llama",', "malformed JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"model_type": "no such type!"}', "model_type"),
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


# ----------------------------------------------------------------------------- issue 16


def test_unknown_link_parameters_are_named_in_a_warning() -> None:
    state, warnings = form.from_query({"micro_bach": "4", "utm_source": "x"}, CARDS, GPUS)
    assert state == {**form.defaults(), "task": "train"}
    assert len(warnings) == 1
    assert "'micro_bach'" in warnings[0] and "'utm_source'" in warnings[0]
    assert "micro_batch" in warnings[0]  # the known names are listed


def test_every_parameter_a_link_writes_is_known() -> None:
    """``to_query`` of a state with every field changed writes only names ``from_query`` knows."""
    for task in form.TASKS:
        written = form.to_query(
            {**form.defaults(), "task": task, "gpu": "h100-80gb", "device": "cpu"}
        )
        assert set(written) <= form.known_params()


def test_an_unknown_card_or_gpu_names_the_default_used() -> None:
    _, warnings = form.from_query({"card": "nope", "gpu": "nope"}, CARDS, GPUS)
    assert f"card='nope' is not a known model card: using {form.defaults()['card']!r}" in warnings
    assert "gpu='nope' is not in the GPU catalog: using the default gpu" in warnings


def test_range_bounds_are_written_as_integers() -> None:
    """The bound of micro_batch printed as ``1,048,576``, not ``1.04858e+06``."""
    _, warnings = form.from_query({"micro_batch": "99999999"}, CARDS, GPUS)
    assert warnings == ["micro_batch='99999999' is out of range: allowed [1, 1,048,576]: using 1"]
