"""``python -m calc``: arguments reach the job classes, bad input exits 2 naming the field, and the
output carries the numbers of the estimate.

Most tests replace ``calc.estimate`` with a fake whose breakdown is chosen here, so the numbers
the CLI must print (GiB, shares, headroom) are derived by hand below, not read from the code.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import calc
from calc.cli import main as cli
from calc.cli import model_source
from calc.data.gpus import get_gpu
from calc.estimate import fallback as estimate_fallback
from tests.hub_cache import TINY, write_snapshot

ROOT = Path(__file__).resolve().parents[3]
GIB = 2**30

# A fake peak, in bytes. "optimizer" has no entry of its own: the CLI must show it as the sum of
# its children, 1.25 + 0.75 = 2 GiB. total = 4 + 2 + 1 = 7 GiB.
FAKE_BREAKDOWN = {
    "weights": 4 * GIB,
    "optimizer/exp_avg": 5 * GIB // 4,
    "optimizer/exp_avg_sq": 3 * GIB // 4,
    "activations": 1 * GIB,
    "total": 7 * GIB,
}
FAKE_LATEX = r"\frac{b s h}{2}"


@dataclass
class FakeEstimate:
    peak_bytes: int
    peak_phase: str = "step1/backward"
    peak_event: str = "layers.0.mlp.grad"
    breakdown: dict[str, int] = field(default_factory=lambda: dict(FAKE_BREAKDOWN))
    phases: dict[str, int] = field(
        default_factory=lambda: {"step1/forward": 5 * GIB, "step1/backward": 7 * GIB}
    )
    notes: tuple[str, ...] = ()

    def latex(self) -> str:
        return FAKE_LATEX


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, object, str]]:
    """Replace the CLI's ``calc.estimate`` with a fake; the list records each call's arguments."""
    seen: list[tuple[object, object, str]] = []

    def fake_estimate(
        model: object,
        job: object,
        parallel: object = None,
        device: str = "cuda",
        gpu: object = None,
    ) -> FakeEstimate:
        assert parallel is None  # no parallelism option given in these tests
        seen.append((model, job, device))
        return FakeEstimate(peak_bytes=7 * GIB)

    monkeypatch.setattr(cli, "estimate", fake_estimate)
    return seen


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the CLI in-process: (exit code, stdout, stderr); argparse's own exits included."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def numbers(text: str) -> set[float]:
    """Every number printed, thousands separators removed."""
    return {float(m.replace(",", "")) for m in re.findall(r"\d[\d,]*(?:\.\d+)?", text)}


# ----------------------------------------------------------------------------- parsing


def test_defaults_are_a_training_job_on_the_default_card(calls, capsys) -> None:
    code, _, _ = run_cli([], capsys)
    assert code == 0
    (model, job, device) = calls[0]
    assert model.n_params == calc.load_card("qwen2.5-32b").n_params
    assert job == calc.Training(micro_batch=1, seq_len=2048)
    assert device == "cuda"


def test_every_training_flag_reaches_its_field(calls, capsys) -> None:
    argv = [
        "--card", "gpt2",
        "--micro-batch", "4",
        "--seq-len", "512",
        "--precision", "bf16-master",
        "--optimizer", "lion",
        "--optimizer-impl", "for-loop",
        "--recompute", "full",
        "--attention", "eager",
        "--implementation", "reference",
        "--grad-accum", "8",
        "--weight-decay", "0.1",
        "--dropout", "0.2",
        "--zero-grad", "before_backward",
        "--device", "cpu",
    ]  # fmt: skip
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    model, job, device = calls[0]
    assert model.n_params == calc.load_card("gpt2").n_params
    assert job == calc.Training(
        micro_batch=4,
        seq_len=512,
        precision="bf16-master",
        optimizer="lion",
        optimizer_impl="for-loop",
        recompute="full",
        attention="eager",
        implementation="reference",
        grad_accum=8,
        weight_decay=0.1,
        dropout=0.2,
        zero_grad="before_backward",
    )
    assert device == "cpu"


def test_compile_flag_reaches_its_field(calls, capsys) -> None:
    code, _, err = run_cli(["--card", "gpt2", "--seq-len", "64", "--compile", "default"], capsys)
    assert code == 0, err
    assert calls[0][1] == calc.Training(micro_batch=1, seq_len=64, compile="default")


def test_every_inference_flag_reaches_its_field(calls, capsys) -> None:
    argv = ["--task", "infer", "--batch", "3", "--context", "1024", "--prompt", "100"]
    argv += ["--precision", "fp16", "--attention", "math", "--implementation", "reference"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert calls[0][1] == calc.Inference(
        batch=3,
        context=1024,
        prompt=100,
        precision="fp16",
        attention="math",
        implementation="reference",
    )


def test_generate_flags_make_a_generate_job(calls, capsys) -> None:
    argv = ["--task", "infer", "--batch", "2", "--prompt", "512", "--new-tokens", "32"]
    code, _, err = run_cli([*argv, "--cache", "static"], capsys)
    assert code == 0, err
    # the context is not the default 4096: prompt + new tokens = 544
    job = calls[0][1]
    assert job == calc.Inference(batch=2, prompt=512, new_tokens=32, cache="static")
    assert job.context == 544


def test_padding_flag_makes_a_left_padded_job(calls, capsys) -> None:
    argv = ["--task", "infer", "--prompt", "16", "--new-tokens", "4", "--padding", "left"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert calls[0][1] == calc.Inference(batch=1, prompt=16, new_tokens=4, padding="left")


def test_sample_flags_make_a_sampling_generate_job(calls, capsys) -> None:
    argv = ["--task", "infer", "--prompt", "16", "--new-tokens", "4", "--sample"]
    code, _, err = run_cli([*argv, "--top-p", "0.9", "--temperature", "0.7"], capsys)
    assert code == 0, err
    sampling = calls[0][1].sampling
    assert sampling == calc.Sampling(top_p=0.9, temperature=0.7)
    assert sampling.top_k == 50  # transformers' default


def test_num_beams_flag_makes_a_beam_search_job(calls, capsys) -> None:
    argv = ["--task", "infer", "--prompt", "16", "--new-tokens", "4", "--num-beams", "3"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert (calls[0][1].num_beams, calls[0][1].sampling) == (3, None)


def test_num_return_sequences_flag_makes_several_sequences_per_prompt(calls, capsys) -> None:
    argv = ["--task", "infer", "--prompt", "16", "--new-tokens", "4", "--sample",
            "--num-return-sequences", "4"]  # fmt: skip
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert calls[0][1].num_return_sequences == 4


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--task", "infer", "--prompt", "16", "--new-tokens", "4", "--top-k", "5"],
         "--top-k need --sample"),
        (["--task", "train", "--sample"], "does not take --sample"),
        (["--task", "train", "--num-beams", "2"], "does not take --num-beams"),
        (["--task", "infer", "--context", "16", "--num-beams", "2"], "needs new_tokens >= 1"),
        (["--task", "train", "--num-return-sequences", "2"], "does not take"),
        (["--task", "infer", "--prompt", "16", "--new-tokens", "4", "--num-return-sequences",
          "2"], "needs sampling or num_beams >= 2"),
        (["--task", "infer", "--prompt", "16", "--new-tokens", "4", "--sample", "--top-p", "2"],
         "top_p=2.0"),
    ],
)  # fmt: skip
def test_sample_flags_are_checked(calls, capsys, argv, says) -> None:
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and says in err


def test_config_file_is_read_as_the_model(calls, capsys, tmp_path: Path) -> None:
    config = calc.load_card_config("qwen2.5-0.5b")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, _, err = run_cli(["--config", str(path)], capsys)
    assert code == 0, err
    assert calls[0][0].n_params == calc.ModelSpec.from_hf_config(config).n_params


def test_a_multimodal_config_file_is_its_language_model_with_a_note(
    calls, capsys, tmp_path: Path
) -> None:
    text = calc.load_card_config("qwen2.5-0.5b")
    composite = {"model_type": "qwen2_5_vl", "text_config": text, "vision_config": {"depth": 32}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(composite))
    code, _, err = run_cli(["--config", str(path)], capsys)
    assert code == 0, err
    assert calls[0][0].n_params == calc.ModelSpec.from_hf_config(text).n_params
    assert "note: multimodal config (qwen2_5_vl)" in err and "vision_config" in err


def test_model_id_is_read_from_the_hub_cache(calls, capsys, tmp_path, monkeypatch) -> None:
    hub = pytest.importorskip("huggingface_hub.constants")
    write_snapshot(tmp_path, "Org/Tiny", TINY)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    code, _, err = run_cli(["--model", "Org/Tiny"], capsys)
    assert code == 0, err
    assert calls[0][0].n_params == 1352  # hand count: test_model_cards.test_tiny_llama_hand_count
    assert "offline" in err and "Org/Tiny" in err  # says the cached copy was used
    # plan and report take the same argument
    args = model_source.parser("plan", "").parse_args(["--model", "Org/Tiny"])
    model, label = model_source.load_model(args)
    assert (model.n_params, label) == (1352, "Org/Tiny")


def test_model_id_in_a_real_process(tmp_path) -> None:
    # A fresh interpreter: huggingface_hub imported only by --model, its cache from HF_HUB_CACHE.
    pytest.importorskip("huggingface_hub")
    write_snapshot(tmp_path, "Org/Tiny", TINY)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    argv = [sys.executable, "-m", "calc", "--model", "Org/Tiny"]
    argv += ["--seq-len", "8", "--implementation", "reference", "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["n_params"] == 1352
    assert "offline" in proc.stderr
    missing = [*argv[:4], "Org/Absent"]
    proc = subprocess.run(missing, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert proc.returncode == 2
    assert "Org/Absent" in proc.stderr and "Traceback" not in proc.stderr


def test_list_cards_prints_every_card(capsys) -> None:
    code, out, _ = run_cli(["--list-cards"], capsys)
    assert code == 0
    assert out.split() == calc.list_cards()


# ----------------------------------------------------------------------------- bad input


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BAD_INPUTS = [
    (["--micro-batch", "0"], "micro_batch"),
    (["--seq-len", "-5"], "seq_len"),
    (["--grad-accum", "0"], "grad_accum"),
    (["--precision", "fp8"], "precision"),
    (["--optimizer", "adamx"], "optimizer"),
    (["--optimizer-impl", "fast"], "optimizer_impl"),
    (["--optimizer", "lion", "--optimizer-impl", "fused"], "optimizer_impl"),
    (["--recompute", "some"], "recompute"),
    (["--attention", "sparse"], "attention"),
    (["--implementation", "jax"], "implementation"),
    (["--dropout", "1.5"], "dropout"),
    (["--weight-decay", "-1"], "weight_decay"),
    (["--zero-grad", "never"], "zero_grad"),
    (["--task", "infer", "--batch", "0"], "batch"),
    (["--task", "infer", "--context", "10", "--prompt", "20"], "prompt"),
    (["--task", "infer", "--precision", "amp-bf16"], "precision"),
    (["--task", "infer", "--optimizer", "adamw"], "--optimizer"),
    (["--task", "train", "--context", "10"], "--context"),
    (["--card", "no-such-model"], "no-such-model"),
    (["--gpu-gib", "0"], "gpu_gib"),
    (["--gpu-gib", "nan"], "gpu_gib"),
    (["--depth", "0"], "depth"),
    # argparse's own checks (types, fixed choices) also exit 2 naming the option
    (["--micro-batch", "four"], "--micro-batch"),
    (["--task", "serve"], "--task"),
    (["--device", "tpu"], "--device"),
    (["--card", "gpt2", "--config", "x.json"], "--config"),
    (["--card", "gpt2", "--model", "Org/Tiny"], "--model"),
    (["--model", "not a/hub id"], "Hugging Face id"),
]


@pytest.mark.parametrize(("argv", "named"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_exits_2_naming_the_field(calls, capsys, argv, named) -> None:
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    assert named in err
    assert out == ""
    assert calls == []


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("{not json", "config"),
        ("[1, 2]", "config"),
        ('{"model_type": "no such type!", "hidden_size": 8}', "model_type"),
    ],
)
def test_bad_config_file_exits_2(calls, capsys, tmp_path, text, named) -> None:
    code, out, err = run_cli(["--config", _write(tmp_path, "c.json", text)], capsys)
    assert (code, out, calls) == (2, "", [])
    assert named in err


def test_missing_config_file_exits_2(calls, capsys, tmp_path) -> None:
    code, _, err = run_cli(["--config", str(tmp_path / "absent.json")], capsys)
    assert code == 2
    assert "config" in err


def test_bad_input_in_a_real_process_has_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "calc", "--card", "gpt2", "--micro-batch", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "micro_batch" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- output


def test_table_shows_the_numbers_of_the_estimate(calls, capsys) -> None:
    code, out, _ = run_cli(["--card", "gpt2", "--gpu-gib", "10"], capsys)
    assert code == 0
    shown = numbers(out)
    # Every node in GiB: weights 4, optimizer 2 (= 1.25 + 0.75), activations 1, total 7.
    assert {4.0, 2.0, 1.25, 0.75, 1.0, 7.0} <= shown
    # Shares of the 7 GiB peak, to one decimal: 4/7 = 57.1 %, 2/7 = 28.6 %, 1/7 = 14.3 %.
    assert {57.1, 28.6, 14.3, 100.0} <= shown
    # The peak in bytes, and the verdict: 10 - 7 = 3 GiB of headroom, 3/10 = 30 % of the GPU.
    assert float(7 * GIB) in shown
    assert {3.0, 30.0} <= shown


def test_depth_hides_deeper_rows(calls, capsys) -> None:
    code, out, _ = run_cli(["--card", "gpt2", "--depth", "1"], capsys)
    assert code == 0
    shown = numbers(out)
    assert 2.0 in shown  # optimizer, the sum of its children
    assert not {1.25, 0.75} & shown  # its children


def test_shortfall_is_the_peak_minus_the_gpu(calls, capsys) -> None:
    code, out, _ = run_cli(["--card", "gpt2", "--gpu-gib", "6.5"], capsys)
    assert code == 0
    assert 0.5 in numbers(out)  # 7 - 6.5 GiB more needed


@pytest.mark.parametrize(
    ("gpu_gib", "fits", "headroom"),
    [(7.0, True, 0), (8.0, True, GIB), (6.0, False, -GIB)],
)
def test_json_verdict(calls, capsys, gpu_gib, fits, headroom) -> None:
    code, out, _ = run_cli(["--card", "gpt2", "--json", "--gpu-gib", str(gpu_gib)], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["peak_bytes"] == 7 * GIB
    assert data["fits"] is fits
    assert data["headroom_bytes"] == headroom
    assert data["breakdown"] == FAKE_BREAKDOWN
    assert data["phases"] == {"step1/forward": 5 * GIB, "step1/backward": 7 * GIB}
    assert data["n_params"] == calc.load_card("gpt2").n_params
    assert data["job"]["micro_batch"] == 1


def test_latex_flag_prints_the_formula(calls, capsys) -> None:
    _, out, _ = run_cli(["--card", "gpt2", "--latex"], capsys)
    assert FAKE_LATEX in out
    _, out, _ = run_cli(["--card", "gpt2", "--latex", "--json"], capsys)
    assert json.loads(out)["latex"] == FAKE_LATEX


def test_breakdown_rows_put_parents_first_and_total_last() -> None:
    rows = cli.breakdown_rows({"b/y": 2, "a": 1, "b/x": 3, "b/x/deep": 3, "total": 6})
    assert rows == [
        (0, "b", 5),  # absent from the mapping: 2 + 3
        (1, "b/y", 2),
        (1, "b/x", 3),
        (2, "b/x/deep", 3),
        (0, "a", 1),
        (0, "total", 6),
    ]


# ----------------------------------------------------------------------------- end to end


def _real_estimate_available() -> bool:
    return hasattr(calc, "estimate")


@pytest.mark.skipif(not _real_estimate_available(), reason="calc.estimate is not written yet")
def test_end_to_end_json_matches_the_library() -> None:
    argv = ["--card", "qwen2.5-0.5b", "--micro-batch", "2", "--seq-len", "128", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "calc", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    est = calc.estimate(calc.load_card("qwen2.5-0.5b"), calc.Training(micro_batch=2, seq_len=128))
    assert data["peak_bytes"] == est.peak_bytes
    assert data["breakdown"]["total"] == est.peak_bytes
    assert data["fits"] is (est.peak_bytes <= 80 * GIB)


@pytest.mark.skipif(not _real_estimate_available(), reason="calc.estimate is not written yet")
def test_end_to_end_table_shows_the_peak() -> None:
    argv = ["--card", "qwen2.5-0.5b", "--task", "infer", "--batch", "2", "--context", "256"]
    proc = subprocess.run(
        [sys.executable, "-m", "calc", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    est = calc.estimate(calc.load_card("qwen2.5-0.5b"), calc.Inference(batch=2, context=256))
    assert float(est.peak_bytes) in numbers(proc.stdout)


# ----------------------------------------------------------------------------- issue 16


@pytest.mark.parametrize(
    "flag",
    [["--pp-schedule", "gpipe"], ["--no-reshard-after-forward"], ["--ddp-bucket-mib", "5"],
     ["--gradient-as-bucket-view"]],
)  # fmt: skip
def test_layout_options_on_one_gpu_answer_and_say_they_do_nothing(flag, capsys) -> None:
    """They raised IndexError (no rank peaks on one GPU)."""
    code, out, err = run_cli(["--card", "gpt2", "--seq-len", "64", *flag], capsys)
    assert code == 0, err
    assert "one GPU: the layout options above have no effect" in out


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_weight_decay_must_be_finite(value, capsys) -> None:
    code, _, err = run_cli(["--card", "gpt2", "--weight-decay", value], capsys)
    assert code == 2
    assert err.startswith("error: weight_decay=") and "finite number >= 0" in err


def test_sizes_beyond_exact_arithmetic_exit_2_in_one_line(capsys) -> None:
    argv = ["--card", "llama-3.1-8b", "--micro-batch", "1048576", "--seq-len", "16777216"]
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "micro_batch=1,048,576" in err


@pytest.mark.parametrize("exc", [MemoryError(), OverflowError("int too large"), RecursionError()])
def test_a_job_too_large_for_the_machine_exits_2_in_one_line(exc, monkeypatch, capsys) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(cli, "estimate", boom)
    code, _, err = run_cli(["--card", "gpt2"], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.startswith("error: this job is too large to compute")


def test_help_names_the_subcommands(capsys) -> None:
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0
    assert "python -m calc plan" in out and "python -m calc report" in out


@pytest.mark.parametrize(
    "argv, instead",
    [
        (["--card", "mistral-7b-v0.1", "--task", "infer", "--batch", "1", "--context", "8192"],
         "--implementation reference"),
        (["--card", "gpt2", "--task", "infer", "--batch", "1", "--context", "64", "--attention", "eager"],
         "attention='sdpa'"),
        (["--card", "llama-3.1-8b", "--task", "infer", "--batch", "1", "--context", "64", "--attention", "eager"],
         "attention='sdpa'"),
        (["--card", "llama-3.1-8b", "--seq-len", "64", "--attention", "eager"], "precision='bf16'"),
        (["--card", "llama-3.1-8b", "--seq-len", "64", "--dropout", "0.1"], "--implementation reference"),
    ],
)  # fmt: skip
def test_not_modelled_says_what_works_instead(argv, instead, capsys, monkeypatch) -> None:
    # the hand-written graphs' refusals, as a user without torch sees them (with torch, the
    # derived replay answers most of them: the next test)
    monkeypatch.setattr(estimate_fallback, "derived_fallback", lambda *args: None)
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and err.startswith("not supported yet:")
    assert instead in err


def test_a_derived_card_without_transformers_says_what_to_install(capsys, monkeypatch) -> None:
    # the core install has no torch: one line naming the packages, never a traceback
    from calc.derive import replay

    monkeypatch.setattr(replay, "missing_recorder", lambda: ("transformers",))
    code, _, err = run_cli(["--card", "phi-4", "--task", "infer", "--context", "64"], capsys)
    assert code == 2 and err.startswith("error: model_type='phi3'")
    assert "install transformers (pip install 'vramplan[verify]')" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "argv, lacks",
    [
        (["--card", "llama-3.1-8b", "--seq-len", "64", "--attention", "eager"], "eager attention"),
        (["--card", "gpt2", "--task", "infer", "--batch", "1", "--context", "64", "--attention", "eager",
          "--device", "cpu"], "kernel 'eager'"),
    ],
)  # fmt: skip
def test_where_the_hand_graph_refuses_the_derived_replay_answers(argv, lacks, capsys) -> None:
    code, out, _ = run_cli(argv, capsys)
    assert code == 0
    assert "derived from transformers' code" in out and lacks in out


def test_with_attention_dropout_on_cuda_the_hand_graphs_refusal_stands(capsys) -> None:
    # the derived replay records CPU kernels: the math kernel for dropout, CUDA keeps flash
    code, _, err = run_cli(
        ["--card", "llama-3.1-8b", "--seq-len", "64", "--dropout", "0.1"], capsys
    )
    assert code == 2 and "dropout" in err


def test_the_default_verdict_uses_the_h100s_usable_memory_like_the_app(capsys) -> None:
    """The CLI compared with 80 GiB, the app with the catalog's usable memory (issue 16)."""
    code, out, _ = run_cli(["--card", "gpt2", "--seq-len", "64", "--json"], capsys)
    assert code == 0
    got = json.loads(out)
    assert got["gpu"] == "h100-80gb"
    # the CUDA total PyTorch reports on an H100, "79.11 GiB" (vllm-project/vllm issue #27508),
    # less the CUDA context's upper end, ">1000MB" (pytorch/pytorch issue #107667)
    assert round(got["gpu_gib"] * 2**30) == round(79.11 * 2**30) - 1000 * 2**20
    from webapp.widgets import _default_gpu

    assert _default_gpu({"h100-80gb": None, "t4-16gb": None}) == "h100-80gb"  # type: ignore[dict-item]


def test_reserved_flag_shows_both_allocator_settings_against_the_total(capsys) -> None:
    # --reserved: per allocator setting, reserved (>= the peak) + the catalog's outside-PyTorch
    # bytes against the GPU's total; the library's own numbers, compared here with the JSON.
    argv = ["--card", "gpt2", "--micro-batch", "1", "--seq-len", "64", "--gpu", "a10-24gb"]
    code, out, _ = run_cli([*argv, "--reserved", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    rows = {r["setting"]: r for r in data["device_fit"]}
    assert set(rows) == {"default", "expandable_segments"}
    gpu = get_gpu("a10-24gb")
    est = calc.estimate(
        calc.load_card("gpt2"), calc.Training(micro_batch=1, seq_len=64), gpu="a10-24gb"
    )
    assert data["peak_bytes"] == est.peak_bytes
    for r in rows.values():
        assert r["reserved_bytes"] >= r["allocated_bytes"] >= est.peak_bytes
        assert r["shown_bytes"] == r["reserved_bytes"] + gpu.reserved_bytes
        assert r["fits"] == (r["shown_bytes"] <= gpu.total_bytes)
    assert rows["default"]["reserved_bytes"] == est.reserved_bytes
    code, text, _ = run_cli([*argv, "--reserved"], capsys)
    assert code == 0 and "expandable_segments:" in text and "does not fit" not in text
