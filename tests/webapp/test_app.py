"""The web calculator under ``streamlit.testing.v1.AppTest``: every widget driven by its key, the
numbers shown compared with ``calc.estimate`` called here on the same inputs, and no exception
for any input, bad configs and bad links included.

The jobs are built in this file from plain keyword arguments (not through ``webapp.form``), so
a wrong mapping from widget to job field shows up as a different peak.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

import calc
from calc.data import gpus
from tests.hub_cache import write_snapshot
from webapp import form

APP = str(Path(__file__).resolve().parents[2] / "app.py")
REPORT = Path(__file__).resolve().parents[2] / "verify" / "reports" / "latest" / "report.json"
CARD = "qwen2.5-0.5b"
"""A small card: compile time does not depend on the size, but keep the numbers readable."""

# One non-default value per widget, and the job keyword it must set. A widget added to the form
# must be added here (test_every_widget_is_driven_here says so).
TRAIN_CHANGES: dict[str, object] = {
    "train.micro_batch": 3,
    "train.seq_len": 512,
    "train.precision": "bf16-master",
    "train.optimizer": "adam8bit",
    "train.paged_optimizer": True,
    "train.recompute": "full",
    "train.attention": "eager",
    "train.optimizer_impl": "for-loop",
    "train.implementation": "reference",
    "train.recompute_every": 2,  # after reference: refused by name, no recording per rerun
    "train.grad_accum": 4,
    "train.weight_decay": 0.1,
    "train.dropout": 0.1,
    "train.zero_grad": "before_backward",
    "train.loop": "hold-output",
    "train.loss": "chunked-ce",
    "train.loss_chunks": 4,
    "train.optimizer_in_backward": True,
    "train.offload_activations": True,
    "train.compile": "default",  # last: a recording (seconds), after implementation=reference:
    # refused by name there (compile records transformers' code)
}
INFER_CHANGES: tuple[tuple[str, object], ...] = (
    ("infer.batch", 4),
    ("infer.context", 1024),
    ("infer.prompt", 512),
    ("infer.precision", "fp16"),
    ("infer.attention", "math"),
    ("infer.implementation", "reference"),
    ("infer.attention", "sdpa"),  # generate is modelled for hf with SDPA: back to them
    ("infer.implementation", "hf"),
    ("infer.new_tokens", 16),  # generate: the context follows from the prompt (context=0)
    ("infer.cache", "static"),
    ("infer.padding", "left"),  # a recording (seconds) of the padded generate
    ("infer.num_beams", 2),  # a recording of beam search (the hand graph refuses it)
    ("infer.num_return_sequences", 2),  # the best 2 of the 2 beams
    ("infer.output_scores", True),  # each step's scores kept: a recording of the whole generate
    ("infer.output_logits", True),
)
"""Inference widget changes in order (a widget may change twice)."""


def _app(query: dict[str, str] | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=180)
    at.query_params.update(query or {})
    at.run()
    return at


def _metric(at: AppTest, label: str) -> str:
    values = [m.value for m in at.metric if m.label == label]
    assert values, f"no metric {label!r}: {[m.label for m in at.metric]}"
    return values[0]


def _expected_gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"  # GiB = 2**30 bytes, two decimals, as the page shows


def _messages(at: AppTest) -> str:
    return "\n".join(str(e.value) for e in [*at.error, *at.warning, *at.success, *at.info])


def _check_page(
    at: AppTest,
    model: calc.ModelSpec,
    job: object,
    gpu_id: str,
    parallel: calc.Parallelism | None = None,
) -> None:
    """No exception; the peak, the verdict and the breakdown table agree with calc.estimate;
    with ``parallel``, the most-loaded rank and every rank's peak too."""
    assert not at.exception, [e.value for e in at.exception]
    try:
        est = calc.estimate(model, job, parallel, gpu=gpu_id)
    except (ValueError, NotImplementedError) as exc:
        assert str(exc) in _messages(at)
        assert not at.metric  # no number for a job the cost model refuses
        return
    assert _metric(at, "peak per GPU") == _expected_gib(est.peak_bytes)
    assert _metric(at, "peak phase") == est.peak_phase
    if parallel is not None:
        assert _metric(at, "most-loaded rank") == str(est.rank)
        ranks = at.dataframe[1].value
        assert dict(zip(ranks["rank"], ranks["bytes"], strict=True)) == est.rank_peaks
    usable = gpus.get_gpu(gpu_id).usable_for(parallel)
    if est.peak_bytes <= usable:
        assert any(str(s.value).startswith("fits with") for s in at.success), _messages(at)
    else:
        assert any(str(e.value).startswith("does not fit:") for e in at.error), _messages(at)
    table = at.dataframe[0].value
    assert Counter(int(b) for b in table["bytes"]) == Counter(
        int(v) for k, v in est.breakdown.items() if not k.startswith("ranks/")
    )
    assert at.latex, "the formula is shown"


def test_every_widget_is_driven_here() -> None:
    # scalar job fields: TRAIN_CHANGES / INFER_CHANGES; the options of the object-valued fields
    # (LoRA, quantization, pruning, distillation, KV cache) and of the parallel layout: CASES
    assert set(TRAIN_CHANGES) == {f.key for f in form.fields_of("train") if not f.of}
    assert {k for k, _ in INFER_CHANGES} == {f.key for f in form.fields_of("infer") if not f.of}
    options = {f.key for f in form.FIELDS if f.of}
    assert options == {k for case in CASES for k in case.values[0]} & options


def test_default_page_shows_the_default_job_of_the_readme() -> None:
    at = _app()
    model = calc.load_card("qwen2.5-32b")
    _check_page(at, model, calc.Training(micro_batch=1, seq_len=2048), "h100-80gb")
    assert at.selectbox(key="card").value == "qwen2.5-32b"
    assert at.query_params["card"] == ["qwen2.5-32b"] or at.query_params["card"] == "qwen2.5-32b"


def _query_value(at: AppTest, name: str) -> str | None:
    value = at.query_params.get(name)
    if isinstance(value, list):
        return value[0] if value else None
    return value


def _set(at: AppTest, key: str, value: object) -> None:
    at.get_by_key(key).set_value(value)  # type: ignore[attr-defined]


def _set_widgets(at: AppTest, widgets: dict[str, object]) -> None:
    """Set widgets as a user would: a switch (LoRA rank, quant, pruning, teacher) first, since
    it enables its options' widgets; then the rest; the page reruns after each round."""
    switches = {f"{f.task}.{f.needs}" for f in form.FIELDS if f.needs}
    for first in (True, False):
        for key, value in widgets.items():
            if (key in switches) == first:
                _set(at, key, value)
        at.run()


@pytest.mark.parametrize(
    ("task", "changes"), [("train", tuple(TRAIN_CHANGES.items())), ("infer", INFER_CHANGES)]
)
def test_every_widget_changes_the_job_as_calc_estimate_sees_it(
    task: str, changes: tuple[tuple[str, object], ...]
) -> None:
    at = _app({"card": CARD})
    model = calc.load_card(CARD)
    if task == "infer":
        at.radio(key="task").set_value("infer").run()
    kwargs: dict[str, object] = (
        {"micro_batch": 1, "seq_len": 2048} if task == "train" else {"batch": 1, "context": 4096}
    )
    job_class = calc.Training if task == "train" else calc.Inference
    _check_page(at, model, job_class(**kwargs), "h100-80gb")
    for key, value in changes:
        if key == "train.optimizer_impl":  # adam8bit has no fused kernel: keep the valid ones
            assert value != "fused"
        _set(at, key, value)
        at.run()
        name = key.split(".", 1)[1]
        kwargs[name] = value
        if name == "new_tokens":
            kwargs["context"] = 0
        _check_page(at, model, job_class(**kwargs), "h100-80gb")
        default = next(f.default for f in form.FIELDS if f.key == key)
        text = str(value).lower() if isinstance(value, bool) else str(value)  # BOOL_TEXT
        in_link = None if value == default else text  # a link leaves defaults out
        assert _query_value(at, name) == in_link, f"{name} not in the link"


@dataclasses.dataclass(frozen=True)
class Case:
    """Widgets set on a fresh page (card qwen2.5-0.5b) and the job they must mean, built here
    from plain keyword arguments."""

    name: str
    values: tuple[dict[str, object], dict[str, object], dict[str, object] | None]
    """(widget key -> value, job keywords, ``calc.Parallelism`` keywords or None)."""

    @property
    def task(self) -> str:
        return next(iter(self.values[0])).split(".")[0]


REF16 = {"train.precision": "bf16", "train.implementation": "reference"}
REF16_JOB = {"precision": "bf16", "implementation": "reference"}
CASES: tuple[Case, ...] = (
    Case("qlora-nf4", ({**REF16, "train.lora_rank": 16, "train.lora_alpha": 32.0,
                        "train.lora_modules": ["q", "v"], "train.quant": "nf4",
                        "train.group_size": 128, "train.double_quant": False},
                       {**REF16_JOB, "lora": calc.LoRA(rank=16, alpha=32.0, modules=("q", "v")),
                        "quant": calc.Quant(method="nf4", group_size=128, double_quant=False)},
                       None)),
    Case("qlora-int4", ({**REF16, "train.lora_rank": 8, "train.quant": "int4",
                         "train.zero_point": "no", "train.scale_dtype": "bf16",
                         "train.lora_dropout": 0.05},
                        {**REF16_JOB, "lora": calc.LoRA(rank=8, dropout=0.05),
                         "quant": calc.Quant(method="int4", zero_point=False, scale_dtype="bf16")},
                        None)),
    Case("qlora-fp8", ({**REF16, "train.lora_rank": 8, "train.quant": "fp8",
                        "train.fp8_scaling": "row"},
                       {**REF16_JOB, "lora": calc.LoRA(rank=8),
                        "quant": calc.Quant(method="fp8", fp8_scaling="row")}, None)),
    Case("lora-hf-refused", ({"train.lora_rank": 4}, {"lora": calc.LoRA(rank=4)}, None)),
    Case("prune", ({"train.implementation": "reference", "train.prune": "unstructured",
                    "train.prune_amount": 0.3, "train.prune_modules": ["q", "up"]},
                   {"implementation": "reference",
                    "pruning": calc.Pruning(amount=0.3, modules=("q", "up"))}, None)),
    Case("prune-2:4-removed", ({"train.implementation": "reference", "train.prune": "2:4",
                                "train.prune_removed": True},
                               {"implementation": "reference",
                                "pruning": calc.Pruning(kind="2:4", removed=True)}, None)),
    Case("distill", ({**REF16, "train.teacher": "qwen2.5-0.5b", "train.teacher_precision": "fp32",
                      "train.teacher_quant": "int8", "train.distill_temperature": 2.0,
                      "train.distill_hard_weight": 0.5},
                     {**REF16_JOB, "distill": calc.Distill(
                         teacher=calc.load_card("qwen2.5-0.5b"), teacher_precision="fp32",
                         teacher_quant=calc.Quant(method="int8"), temperature=2.0,
                         hard_weight=0.5)}, None)),
    Case("infer-int8", ({"infer.implementation": "reference", "infer.quant": "int8",
                         "infer.zero_point": "yes", "infer.scale_dtype": "bf16",
                         "infer.kv_quant": "int8"},
                        {"implementation": "reference", "kv_quant": "int8",
                         "quant": calc.Quant(method="int8", zero_point=True, scale_dtype="bf16")},
                        None)),
    Case("infer-nf4", ({"infer.quant": "nf4", "infer.group_size": 128,
                        "infer.double_quant": False},
                       {"quant": calc.Quant(method="nf4", group_size=128, double_quant=False)},
                       None)),
    Case("qlora-nf4-head-refused", ({**REF16, "train.lora_rank": 8, "train.quant": "nf4",
                                     "train.quant_lm_head": True},
                                    {**REF16_JOB, "lora": calc.LoRA(rank=8),
                                     "quant": calc.Quant(method="nf4",
                                                         keep_16bit=("embed", "norm"))},
                                    None)),
    Case("infer-nf4-head-refused", ({"infer.implementation": "reference", "infer.quant": "nf4",
                                     "infer.quant_lm_head": True},
                                    {"implementation": "reference",
                                     "quant": calc.Quant(method="nf4",
                                                         keep_16bit=("embed", "norm"))},
                                    None)),
    Case("infer-fp8", ({"infer.quant": "fp8", "infer.fp8_scaling": "row"},
                       {"quant": calc.Quant(method="fp8", fp8_scaling="row")}, None)),
    Case("infer-sample", ({"infer.prompt": 64, "infer.new_tokens": 4,
                           "infer.do_sample": "sample", "infer.top_p": 0.9,
                           "infer.temperature": 0.7, "infer.top_k": 20,
                           "infer.repetition_penalty": 1.1, "infer.num_return_sequences": 3},
                          {"context": 0, "prompt": 64, "new_tokens": 4, "num_return_sequences": 3,
                           "sampling": calc.Sampling(top_p=0.9, temperature=0.7, top_k=20,
                                                     repetition_penalty=1.1)}, None)),
    Case("dp2-zero3", ({"train.dp": 2, "train.zero": 3}, {}, {"dp": 2, "zero": 3})),
    Case("tp2", ({"train.tp": 2}, {}, {"tp": 2})),
    Case("tp2-sp-vocab", ({"train.tp": 2, "train.sp": True, "train.vocab_parallel": True}, {},
                          {"tp": 2, "sp": True, "vocab_parallel": True})),
    Case("pp2-interleaved", ({"train.micro_batch": 2, "train.pp": 2,
                              "train.pp_schedule": "interleaved-1f1b",
                              "train.pp_virtual_stages": 2, "train.pp_microbatches": 2},
                             {"micro_batch": 2},
                             {"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2,
                              "pp_microbatches": 2})),
    Case("fsdp", ({"train.dp": 2, "train.fsdp": True, "train.reshard_after_forward": False}, {},
                  {"dp": 2, "fsdp": True, "reshard_after_forward": False})),
    Case("fsdp-mixed-precision", ({"train.precision": "fp32", "train.implementation": "reference",
                                   "train.dp": 2, "train.fsdp": True,
                                   "train.fsdp_param_dtype": "bf16",
                                   "train.fsdp_reduce_dtype": "bf16",
                                   "train.fsdp_cast_forward_inputs": False},
                                  {"precision": "fp32", "implementation": "reference"},
                                  {"dp": 2, "fsdp": True, "fsdp_param_dtype": "bf16",
                                   "fsdp_reduce_dtype": "bf16",
                                   "fsdp_cast_forward_inputs": False})),
    Case("fsdp1-orig-params", ({"train.dp": 2, "train.fsdp": True, "train.fsdp_version": 1,
                                "train.fsdp_use_orig_params": True}, {},
                               {"dp": 2, "fsdp": True, "fsdp_version": 1,
                                "fsdp_use_orig_params": True})),
    Case("fsdp-output-dtype", ({"train.precision": "fp32", "train.dp": 2, "train.fsdp": True,
                                "train.fsdp_param_dtype": "bf16",
                                "train.fsdp_output_dtype": "fp32"},
                               {"precision": "fp32"},
                               {"dp": 2, "fsdp": True, "fsdp_param_dtype": "bf16",
                                "fsdp_output_dtype": "fp32"})),
    Case("hsdp", ({"train.dp": 4, "train.fsdp": True, "train.dp_replicate": 2}, {},
                  {"dp": 4, "fsdp": True, "dp_replicate": 2})),
    Case("tp2-expert-parallel-refused", ({"train.tp": 2, "train.expert_parallel": True}, {},
                                         {"tp": 2, "expert_parallel": True})),
    Case("ddp-buckets", ({"train.dp": 2, "train.ddp_bucket_mib": 4,
                          "train.gradient_as_bucket_view": True}, {},
                         {"dp": 2, "ddp_bucket_mib": 4, "gradient_as_bucket_view": True})),
    Case("zero1-by-parameter", ({"train.dp": 2, "train.zero": 1,
                                 "train.zero_partition": "by-parameter"}, {},
                                {"dp": 2, "zero": 1, "zero_partition": "by-parameter"})),
    Case("cp-offload", ({"train.cp": 2, "train.dp": 2, "train.zero": 2,
                         "train.offload": "optimizer"}, {},
                        {"cp": 2, "dp": 2, "zero": 2, "offload": "optimizer"})),
    Case("parallel-lora-refused", ({**REF16, "train.lora_rank": 8, "train.dp": 2},
                                   {**REF16_JOB, "lora": calc.LoRA(rank=8)}, {"dp": 2})),
)  # fmt: skip
"""Most give numbers; ``lora-hf-refused`` (LoRA needs the reference code), the two
``*-nf4-head-refused`` (the reference graph keeps the LM head in 16 bits; the replay derived
from transformers' code answers the ``hf`` job),
``tp2-sp-vocab`` (sequence parallelism), ``zero1-by-parameter`` (24 layers),
``tp2-expert-parallel-refused`` (experts are recorded on derived MoE models) and
``parallel-lora-refused`` are combinations the cost model refuses: the page shows its message."""


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compression_and_parallel_widgets_give_calc_estimate_of_the_same_job(case: Case) -> None:
    widgets, job_kwargs, parallel_kwargs = case.values
    at = _app({"card": CARD})
    if case.task == "infer":
        at.radio(key="task").set_value("infer").run()
    _set_widgets(at, widgets)
    model = calc.load_card(CARD)
    if case.task == "train":
        job: object = calc.Training(**{"micro_batch": 1, "seq_len": 2048, **job_kwargs})
    else:
        job = calc.Inference(**{"batch": 1, "context": 4096, **job_kwargs})
    parallel = calc.Parallelism(**parallel_kwargs) if parallel_kwargs else None
    _check_page(at, model, job, "h100-80gb", parallel)
    for key, value in widgets.items():  # every option is in the shareable link
        text = ",".join(value) if isinstance(value, list) else str(value)
        text = text.lower() if isinstance(value, bool) else text
        assert _query_value(at, key.split(".", 1)[1]) == text, key


def test_bad_compression_and_parallel_values_are_messages_not_exceptions() -> None:
    at = _app({"card": CARD, "lora_rank": "abc", "quant": "int3", "dp": "0", "fsdp": "maybe",
               "lora_modules": "q,x"})  # fmt: skip
    warnings = "\n".join(str(w.value) for w in at.warning)
    for name in ("lora_rank", "quant", "dp", "fsdp", "lora_modules"):
        assert name in warnings
    _check_page(at, calc.load_card(CARD), calc.Training(micro_batch=1, seq_len=2048), "h100-80gb")
    # valid widgets, invalid combinations: the message of the class that refuses them
    for changes, words in (
        ({"train.sp": True}, "sp=True needs tp > 1"),
        ({"train.sp": False, "train.tp": 3}, "tp=3 does not divide"),
        ({"train.tp": 1, "train.lora_rank": 8, "train.lora_modules": []}, "lora_modules"),
        ({"train.lora_modules": ["q"], "train.quant": "nf4", "train.group_size": 100},
         "group_size=100 must be one of"),
        ({"train.lora_rank": None, "train.quant": "int8", "train.group_size": None},
         "needs lora=calc.LoRA"),
    ):  # fmt: skip
        _set_widgets(at, changes)
        assert not at.exception, (changes, [e.value for e in at.exception])
        assert words in _messages(at), (changes, _messages(at))
        assert not at.metric


def test_gpu_choice_moves_the_verdict_for_every_catalog_gpu() -> None:
    at = _app({"card": "qwen2.5-7b", "recompute": "full"})
    model = calc.load_card("qwen2.5-7b")
    job = calc.Training(micro_batch=1, seq_len=2048, recompute="full")
    for gpu_id in gpus.gpu_catalog():
        at.selectbox(key="gpu").set_value(gpu_id).run()
        _check_page(at, model, job, gpu_id)
        assert _query_value(at, "gpu") == gpu_id


def test_card_picker_and_device_switch() -> None:
    at = _app()
    at.selectbox(key="card").set_value("gpt2").run()
    job = calc.Training(micro_batch=1, seq_len=2048)
    _check_page(at, calc.load_card("gpt2"), job, "h100-80gb")
    assert _query_value(at, "card") == "gpt2"
    at.radio(key="device").set_value("cpu").run()
    assert not at.exception, [e.value for e in at.exception]
    cpu = calc.estimate(calc.load_card("gpt2"), job, device="cpu")
    assert _metric(at, "peak per GPU") == _expected_gib(cpu.peak_bytes)
    assert _query_value(at, "device") == "cpu"


def test_hugging_face_id_from_the_local_cache(tmp_path: Path, monkeypatch) -> None:
    hub = pytest.importorskip("huggingface_hub.constants")
    write_snapshot(tmp_path, "Qwen/Qwen2.5-0.5B", calc.load_card_config("qwen2.5-0.5b"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache written above, never the network
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    at = _app({"model": "Qwen/Qwen2.5-0.5B"})
    job = calc.Training(micro_batch=1, seq_len=2048)
    _check_page(at, calc.load_card("qwen2.5-0.5b"), job, "h100-80gb")
    assert "offline" in _messages(at)  # says the cached copy was used
    assert _query_value(at, "model") == "Qwen/Qwen2.5-0.5B"
    at.text_input(key="hf_id").set_value("Org/Absent").run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Org/Absent" in _messages(at)
    assert not at.metric


def test_a_job_calc_cannot_estimate_yet_is_a_message_not_an_exception() -> None:
    # ZeRO-1 is not modelled on a derived architecture (phi-4 is phi3, recorded from its
    # modeling code): calc.estimate raises NotImplementedError naming the layouts it has
    at = _app({"card": "phi-4", "dp": "2", "zero": "1"})
    assert not at.exception, [e.value for e in at.exception]
    assert "model_type='phi3'" in _messages(at)
    assert not at.metric


def test_a_derived_card_without_transformers_is_a_message_naming_the_install(monkeypatch) -> None:
    # scripts/run.sh's install has no torch: a derived card (phi-4 is phi3) says what to
    # install, its parameter count left out of the caption, and the page does not crash
    from calc.derive import replay

    monkeypatch.setattr(replay, "missing_recorder", lambda: ("torch", "transformers"))
    at = _app({"card": "phi-4"})
    assert not at.exception, [e.value for e in at.exception]
    assert "pip install 'vramplan[verify]'" in _messages(at)
    assert any("parameters not counted" in c.value for c in at.caption)
    assert not at.metric


def test_an_invalid_combination_is_an_error_message_not_an_exception() -> None:
    at = _app({"card": CARD, "optimizer": "lion"})
    at.selectbox(key="train.optimizer_impl").set_value("fused").run()
    assert not at.exception
    assert "optimizer_impl='fused' is not available for optimizer='lion'" in _messages(at)


def test_a_shared_link_restores_the_page() -> None:
    query = {"task": "infer", "card": "mistral-7b-v0.1", "gpu": "l40s-48gb", "batch": "8",
             "context": "8192", "prompt": "1024", "precision": "fp16"}  # fmt: skip
    at = _app(query)
    job = calc.Inference(batch=8, context=8192, prompt=1024, precision="fp16")
    _check_page(at, calc.load_card("mistral-7b-v0.1"), job, "l40s-48gb")
    assert at.number_input(key="infer.batch").value == 8
    assert at.selectbox(key="gpu").value == "l40s-48gb"


def test_a_bad_link_warns_and_falls_back_to_defaults() -> None:
    at = _app({"card": "gpt-5", "micro_batch": "-3", "precision": "fp8", "gpu": "x"})
    _check_page(at, calc.load_card("qwen2.5-32b"), calc.Training(micro_batch=1, seq_len=2048),
                "h100-80gb")  # fmt: skip
    warnings = "\n".join(str(w.value) for w in at.warning)
    for name in ("card", "micro_batch", "precision", "gpu"):
        assert name in warnings


def test_pasted_config_is_estimated_like_the_same_config_from_python() -> None:
    config = calc.load_card_config("gpt2")
    at = _app()
    at.radio(key="source").set_value("paste").run()
    assert not at.exception
    at.text_area(key="config").set_value(json.dumps(config)).run()
    model = calc.ModelSpec.from_hf_config(config)
    _check_page(at, model, calc.Training(micro_batch=1, seq_len=2048), "h100-80gb")
    assert json.loads(_query_value(at, "config") or "") == config


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b'{"model_type": "llama", "hidden_size": 64', "malformed JSON"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "not UTF-8"),
        (b'["a list"]', "JSON object"),
        (b'{"model_type": "no such type!"}', "model_type"),
        (b'{"model_type": "t5"}', "hidden_size"),  # any type is read (derived): its sizes
        (b'{"model_type": "llama", "hidden_size": 64}', "missing required key"),
        (b" " * (300 * 1024), "limit"),
    ],
)
def test_bad_uploads_show_an_error_naming_the_problem(data: bytes, words: str) -> None:
    at = _app()
    at.radio(key="source").set_value("upload").run()
    at.file_uploader(key="config_file").upload("config.json", data, "application/json").run()
    assert not at.exception, [e.value for e in at.exception]
    errors = "\n".join(str(e.value) for e in at.error)
    assert words in errors
    assert not at.metric  # no estimate without a model


def test_good_upload_is_estimated() -> None:
    config = calc.load_card_config("llama-2-7b")
    at = _app()
    at.radio(key="source").set_value("upload").run()
    data = json.dumps(config).encode()
    at.file_uploader(key="config_file").upload("config.json", data, "application/json").run()
    _check_page(at, calc.ModelSpec.from_hf_config(config), calc.Training(micro_batch=1, seq_len=2048),
                "h100-80gb")  # fmt: skip


def test_a_config_too_large_for_64_bit_bytes_is_an_error_not_an_exception() -> None:
    # 2**40 hidden x 10**9 vocabulary x 2 bytes > 2**63: no int64 holds the embedding's bytes
    config = calc.load_card_config("llama-2-7b")
    config.update(hidden_size=2**40, intermediate_size=2**42, num_hidden_layers=10**6,
                  num_attention_heads=2**33, num_key_value_heads=2**33, vocab_size=10**9)  # fmt: skip
    at = _app()
    at.radio(key="source").set_value("paste").run()
    at.text_area(key="config").set_value(json.dumps(config)).run()
    assert not at.exception, [e.value for e in at.exception]
    # refused before any int64 sum (calc.estimate.core), naming the config fields to check
    assert "8 PiB" in "\n".join(str(e.value) for e in at.error)
    assert "hidden_size, num_hidden_layers and vocab_size" in "\n".join(
        str(e.value) for e in at.error
    )


def test_bad_pastes_show_an_error_and_no_exception() -> None:
    at = _app()
    at.radio(key="source").set_value("paste").run()
    for text in ["", "{", "null", '{"model_type": "gpt2", "n_embd": 7, "n_head": 2}', "1e999"]:
        at.text_area(key="config").set_value(text).run()
        assert not at.exception, (text, [e.value for e in at.exception])
        assert at.error, text


def test_verification_page_shows_the_latest_report() -> None:
    report = json.loads(REPORT.read_text(encoding="utf-8"))
    at = _app()
    at.switch_page("webapp/pages/evidence.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert _metric(at, "cases") == str(report["summary"]["cases"])
    assert _metric(at, "not modelled") == str(report["summary"]["not_modelled"])
    table = at.dataframe[-1].value
    assert len(table) == len(report["cases"])
    by_name = {c["name"]: c for c in report["cases"]}
    for _, row in table.iterrows():
        case = by_name[row["case"]]
        if case["predicted_peak"] is not None:
            assert row["predicted_mib"] * 2**20 == pytest.approx(case["predicted_peak"], abs=1)
            assert row["measured_mib"] * 2**20 == pytest.approx(case["measured_peak"], abs=1)
    counts: dict[str, int] = {}
    for case in report["cases"]:
        counts[case["status"]] = counts.get(case["status"], 0) + 1
    for status, count in counts.items():  # the filter shows exactly the cases of one status
        at.multiselect(key="evidence.status").set_value([status]).run()
        assert len(at.dataframe[-1].value) == count, status


# ----------------------------------------------------------------------------- planner page


@pytest.fixture
def plan_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path / "plan-cache"))


SIDEBAR_JOB = {"optimizer": "adamw", "optimizer_impl": "foreach", "attention": "sdpa",
               "implementation": "hf", "precision": "amp-bf16"}  # fmt: skip
"""The sidebar's default job values, which the planner keeps on the axes it does not explore."""


def _row_job(row: Any, seq_len: int, **extra: Any) -> calc.Training:
    """The job of a planner table row: its micro_batch, grad_accum and recompute, the rest the
    sidebar's."""
    return calc.Training(micro_batch=int(row["micro_batch"]), seq_len=seq_len,
                         grad_accum=int(row["grad_accum"]), recompute=row["recompute"],
                         **SIDEBAR_JOB, **extra)  # fmt: skip


def test_planner_page_rows_are_calc_estimates(plan_cache) -> None:
    at = _app({"card": CARD, "seq_len": "1024", "explore": "recompute"})
    at.switch_page("webapp/pages/planner.py").run()
    assert not at.exception, [e.value for e in at.exception]
    at.number_input(key="plan.global_batch").set_value(4).run()
    at.selectbox(key="plan.rank_by").set_value("headroom").run()
    assert not at.exception, [e.value for e in at.exception]
    assert _query_value(at, "global_batch") == "4"
    assert _query_value(at, "rank_by") == "headroom"
    model = calc.load_card(CARD)
    table = at.dataframe[0].value
    assert len(table) > 0
    # axes not explored hold the sidebar's (default) job values and are not columns
    assert not set(SIDEBAR_JOB) & set(table.columns)
    for _, row in table.iterrows():
        job = _row_job(row, seq_len=1024)
        # every (micro_batch x grad_accum) covers the global batch of 4 on one GPU
        assert job.micro_batch * job.grad_accum == 4
        assert row["peak_gib"] * 2**30 == pytest.approx(calc.estimate(model, job).peak_bytes, abs=1)
    headrooms = list(table["headroom_gib"])
    assert headrooms == sorted(headrooms, reverse=True)  # ranked by headroom
    at.selectbox(key="plan.task").set_value("inference").run()
    at.multiselect(key="plan.explore").set_value([]).run()
    at.number_input(key="plan.gpu_count").set_value(2).run()
    assert not at.exception, [e.value for e in at.exception]
    assert _query_value(at, "plan_task") == "inference"


TINY_PHI3 = {
    "model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
    "max_position_embeddings": 512, "pad_token_id": 0,
}  # fmt: skip
"""A pasted Phi-3 config small enough to record in seconds (phi3 has no hand-written graph)."""


def test_planner_page_on_a_derived_model_holds_precision_and_plans_inference(plan_cache) -> None:
    # phi3 is recorded from transformers' code (seconds per structure): its training plan
    # keeps the sidebar's precision (explored by default) and says so; its inference grid (one
    # structure per precision and size regime) is swept. Every row is calc.estimate's.
    at = _app({"seq_len": "64"})
    at.radio(key="source").set_value("paste").run()
    at.text_area(key="config").set_value(json.dumps(TINY_PHI3)).run(timeout=600)
    at.switch_page("webapp/pages/planner.py").run(timeout=600)
    assert not at.exception, [e.value for e in at.exception]
    assert "precision stay at the sidebar's values" in _messages(at)
    model = calc.ModelSpec.from_hf_config(TINY_PHI3)
    table = at.dataframe[0].value
    assert len(table) > 0
    assert "precision" not in table.columns  # one value, named in the caption
    for _, row in table.iterrows():
        job = _row_job(row, seq_len=64)
        assert row["peak_gib"] * 2**30 == pytest.approx(calc.estimate(model, job).peak_bytes, abs=1)
    at.selectbox(key="plan.task").set_value("inference").run(timeout=600)
    assert not at.exception, [e.value for e in at.exception]
    table = at.dataframe[0].value
    assert len(table) > 0
    for _, row in table.iterrows():
        precision = row["precision"] if "precision" in table.columns else "bf16"
        job = calc.Inference(batch=int(row["micro_batch"]), context=64, precision=precision)
        assert row["peak_gib"] * 2**30 == pytest.approx(calc.estimate(model, job).peak_bytes, abs=1)


def test_planner_page_on_lora_rows_are_calc_estimates_of_the_adapter_job(plan_cache) -> None:
    # task "lora": the sidebar's job plus rank-16 adapters on every linear (the planner's
    # documented default rank, README "Capacity planner"); each row is calc.estimate of that job.
    at = _app({"card": CARD, "explore": "recompute"})
    at.switch_page("webapp/pages/planner.py").run()
    at.selectbox(key="plan.task").set_value("lora").run()
    assert not at.exception, [e.value for e in at.exception]
    assert _query_value(at, "plan_task") == "lora"
    model = calc.load_card(CARD)
    table = at.dataframe[0].value
    assert len(table) > 0
    for _, row in table.iterrows():
        job = _row_job(row, seq_len=2048, lora=calc.LoRA(rank=16))
        assert row["peak_gib"] * 2**30 == pytest.approx(calc.estimate(model, job).peak_bytes, abs=1)


def test_planner_page_changes_to_fit_list_changes_that_fit(plan_cache) -> None:
    # Qwen2.5-0.5B, full fine-tune of 4 x 4096 tokens: 58.8 GiB, over an A100-40GB's usable
    # memory. The search behind the switch lists changes; each one, applied to the sidebar's
    # job here (global batch kept: micro_batch x grad_accum = 4), must fit by calc.estimate.
    at = _app({"card": CARD, "micro_batch": "4", "seq_len": "4096",
               "gpu": "a100-40gb"})  # fmt: skip
    at.switch_page("webapp/pages/planner.py").run()
    assert not at.exception, [e.value for e in at.exception]
    at.toggle(key="plan.changes").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    lines = [str(m.value) for m in at.markdown if str(m.value).startswith("- ")]
    assert lines, _messages(at)
    changes = [line[2:] for line in lines[-1].split("\n")]
    model = calc.load_card(CARD)
    usable = gpus.get_gpu("a100-40gb").usable_bytes
    base = calc.Training(micro_batch=4, seq_len=4096)
    assert calc.estimate(model, base, gpu="a100-40gb").peak_bytes > usable
    for text in changes:
        knobs = dict(part.split(": ") for part in text.split(" (peak")[0].split(", "))
        fields: dict[str, object] = {}
        for knob, move in knobs.items():
            new = move.split(" -> ")[1]
            fields[knob] = int(new) if knob == "micro_batch" else new
        if "micro_batch" in fields:
            fields["grad_accum"] = 4 // int(fields["micro_batch"])  # type: ignore[call-overload]
        job = dataclasses.replace(base, **fields)  # type: ignore[arg-type]
        peak = calc.estimate(model, job, gpu="a100-40gb").peak_bytes
        assert peak <= usable, (text, peak)
        assert f"peak {peak / 2**30:.2f} GiB" in text


# ----------------------------------------------------------------------------- issue 16


def test_sizes_beyond_exact_arithmetic_are_one_error_line() -> None:
    """This link showed a raw traceback with server paths (an OverflowError after the estimate)."""
    at = _app({"card": "llama-3.1-8b", "micro_batch": "1048576", "seq_len": "16777216"})
    assert not at.exception
    assert [str(e.value) for e in at.error] == [
        "micro_batch=1,048,576, seq_len=16,777,216 with llama-3.1-8b: the memory of this job "
        "reaches 2**53 bytes (8 PiB), beyond what the estimate computes exactly; use smaller "
        "sizes (or check the model's hidden_size, num_hidden_layers and vocab_size)"
    ]


def test_the_largest_accumulation_answers_like_two() -> None:
    """``grad_accum=1000`` ran the server out of memory (every micro-batch was replayed); any
    count from 2 on has the peak of 2 (the later micro-batches repeat the second)."""
    at = _app({"card": "gpt2", "grad_accum": "65536"})
    assert not at.exception and not at.error
    two = calc.estimate(
        calc.load_card("gpt2"), calc.Training(micro_batch=1, seq_len=2048, grad_accum=2)
    )
    assert _metric(at, "peak per GPU").startswith(_expected_gib(two.peak_bytes))


def test_a_change_does_not_open_the_compression_section() -> None:
    """The LoRA modules' multiselect gave a list where the default is a tuple: after any change
    the compression expander opened by itself."""
    at = _app({"card": "gpt2"})
    at.number_input(key="train.micro_batch").set_value(2).run()
    assert {e.label: e.proto.expanded for e in at.expander}["compression"] is False


def test_planner_on_two_gpus_shows_every_column_that_varies(plan_cache) -> None:
    """On 2 GPUs the layout column was hidden: rows looked identical with different peaks, and
    the caption named axes as enumerated that were held (issue 16)."""
    at = _app({"card": CARD, "seq_len": "256", "gpu_count": "2"})
    at.switch_page("webapp/pages/planner.py").run()
    assert not at.exception, [e.value for e in at.exception]
    table = at.dataframe[0].value
    numbers = {"rank", "peak_gib", "headroom_gib", "headroom_pct", "throughput_proxy", "error_bar"}
    config = [c for c in table.columns if c not in numbers]
    assert "parallel" in config
    assert not table.duplicated(subset=config).any()  # each row is a different configuration
    caption = next(c.value for c in at.caption if "Enumerated:" in c.value)
    enumerated = caption.split("Enumerated: ", 1)[1].split(";", 1)[0].split(" x ")
    assert set(enumerated) >= {c for c in config if table[c].nunique() > 1}
    held = caption.split("the same in every configuration: ", 1)[1]
    for axis in enumerated:
        assert f"{axis}=" not in held
