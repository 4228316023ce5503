"""``Training.compile``: validated at the edge; ``compile="default"`` estimated from Inductor's
own generated code run on fake tensors (`calc.derive.inductor`), checked against measured
compiled steps; refused by name where it is not recorded."""

from __future__ import annotations

from dataclasses import replace

import pytest

import calc
from calc.config.jobs import COMPILES, Training
from tests.specs import tiny_llama


def _spec() -> calc.ModelSpec:
    return tiny_llama()


def test_choices_are_none_and_default() -> None:
    assert COMPILES == ("none", "default", "regional")
    assert Training(micro_batch=1, seq_len=8).compile == "none"


def test_unknown_mode_names_the_field() -> None:
    with pytest.raises(ValueError, match="compile='max-autotune' is not one of"):
        Training(micro_batch=1, seq_len=8, compile="max-autotune")  # type: ignore[arg-type]


def test_none_is_the_eager_estimate() -> None:
    # compile="none" is the default: the same job spelled both ways gives the same bytes
    plain = Training(micro_batch=2, seq_len=32, precision="fp32")
    spelled = Training(micro_batch=2, seq_len=32, precision="fp32", compile="none")
    spec = _spec()
    assert calc.estimate(spec, spelled).peak_bytes == calc.estimate(spec, plain).peak_bytes


def test_reference_implementation_is_refused_by_name() -> None:
    # verify's own model is not transformers' code: there is nothing to compile and record
    job = Training(
        micro_batch=2, seq_len=32, precision="fp32", implementation="reference", compile="default"
    )
    with pytest.raises(NotImplementedError, match="compile='default'"):
        calc.estimate(_spec(), job)


class TestRecorded:
    """Needs torch and transformers (the recording compiles transformers' model)."""

    @pytest.fixture(autouse=True)
    def _needs_torch(self) -> None:
        pytest.importorskip("torch")
        pytest.importorskip("transformers")

    def test_measured_compiled_steps_are_predicted_to_the_byte(self) -> None:
        from verify.cases.compiled import compiled_cases

        # measured peaks, CPU, python -m verify --cases compile-hf-llama (verify.measure.alloc:
        # the profiler's allocation events of the real compiled step, after a warm-up)
        measured = {"compile-hf-llama-fp32": 10_238_464, "compile-hf-llama-bf16": 5_147_136}
        cases = {c.name: c for c in compiled_cases()}
        for name, peak in measured.items():
            case = cases[name]
            assert calc.estimate(case.spec(), case.job, device="cpu").peak_bytes == peak, name

    def test_recomputation_and_regional_compile_are_predicted_to_the_byte(self) -> None:
        from verify.cases.compiled import compiled_cases

        # measured peaks, CPU, python -m verify --cases compile-hf-llama-recompute,regional-hf-llama
        # (checkpointed layers inside the compiled graph: run_and_save_rng_state; each decoder
        # layer compiled on its own)
        measured = {
            "compile-hf-llama-recompute-bf16": 3_443_200,
            "compile-regional-hf-llama-bf16": 6_585_856,
        }
        cases = {c.name: c for c in compiled_cases()}
        for name, peak in measured.items():
            case = cases[name]
            assert calc.estimate(case.spec(), case.job, device="cpu").peak_bytes == peak, name

    def test_regional_compile_says_which_layers_dynamo_compiles(self) -> None:
        from verify.cases.compiled import compiled_cases

        case = next(c for c in compiled_cases() if c.name == "compile-regional-hf-llama-bf16")
        est = calc.estimate(case.spec(), case.job, device="cpu")
        assert any("recompile_limit" in n for n in est.notes)

    def test_compiling_saves_less_than_eager(self) -> None:
        # the partitioner recomputes RoPE, SwiGLU and the log-softmax instead of saving them
        # (docs/compile.md): the compiled backward peak is below the eager one
        from verify.cases.compiled import compiled_cases

        case = next(c for c in compiled_cases() if c.name == "compile-hf-llama-bf16")
        compiled = calc.estimate(case.spec(), case.job, device="cpu")
        eager = calc.estimate(case.spec(), replace(case.job, compile="none"), device="cpu")
        assert compiled.peak_bytes < eager.peak_bytes
        assert compiled.phases["step1/optimizer"] == eager.phases["step1/optimizer"]
        assert any("Inductor" in n for n in compiled.notes)

    def test_cuda_says_the_program_is_the_cpu_one(self) -> None:
        from verify.cases.compiled import compiled_cases

        case = next(c for c in compiled_cases() if c.name == "compile-hf-llama-bf16")
        est = calc.estimate(case.spec(), case.job, device="cuda")
        assert any("not been measured on a GPU" in n for n in est.notes)

    def test_compiled_layers_under_fsdp2_are_predicted_to_the_byte(self) -> None:
        from verify.cases.distributed import CASES

        # measured peaks on both ranks, CPU, python -m verify --cases
        # dist-fsdp2-hf-compile,dist-fsdp2-mp-hf-compile (2026-12-06; verify.dist.profiled:
        # the profiler's allocation events, each layer's forward compiled, FSDP2 over a fake
        # group of 2 ranks)
        measured = {
            "dist-fsdp2-hf-compile-2": 2_484_736,
            "dist-fsdp2-mp-hf-compile-2": 4_033_536,
        }
        cases = {c.name: c for c in CASES}
        for name, peak in measured.items():
            case = cases[name]
            est = calc.estimate(case.spec(), case.job, parallel=case.parallel, device="cpu")
            assert est.peak_bytes == peak, name

    def test_compiling_under_fsdp2_keeps_the_sharded_optimizer_phase(self) -> None:
        # the optimizer steps eagerly on the rank's shards, compiled layers or not: its phase
        # holds the same sharded weights, gradients and states (the recording once compiled
        # an unsharded model here and held every tensor whole)
        from verify.cases.distributed import CASES

        case = next(c for c in CASES if c.name == "dist-fsdp2-hf-compile-2")
        par = case.parallel
        compiled = calc.estimate(case.spec(), case.job, parallel=par, device="cpu")
        eager = calc.estimate(case.spec(), replace(case.job, compile="none"), par, "cpu")
        assert compiled.phases["step1/optimizer"] == eager.phases["step1/optimizer"]
        assert compiled.peak_bytes < eager.peak_bytes

    def test_data_parallel_is_refused_by_name(self) -> None:
        job = Training(micro_batch=2, seq_len=64, implementation="hf", compile="default")
        with pytest.raises(NotImplementedError, match="not with DDP"):
            calc.estimate(_spec(), job, parallel=calc.Parallelism(dp=2), device="cpu")


@pytest.mark.parametrize(
    ("compile_mode", "parallel", "covered"),
    [
        ("regional", calc.Parallelism(dp=8, fsdp=True), True),
        ("regional", calc.Parallelism(dp=2, fsdp=True, fsdp_param_dtype="bf16"), True),
        ("default", calc.Parallelism(dp=8, fsdp=True), False),  # hooks inside one graph
        ("regional", calc.Parallelism(dp=2), False),  # DDP
        ("regional", calc.Parallelism(dp=2, fsdp=True, fsdp_version=1), False),
        ("regional", calc.Parallelism(dp=2, tp=2, fsdp=True), False),
        ("regional", calc.Parallelism(dp=2, fsdp=True, offload="optimizer"), False),
    ],
)
def test_compiled_parallel_layouts_covered(
    compile_mode: str, parallel: calc.Parallelism, covered: bool
) -> None:
    from calc.estimate.api import compiles_sharded

    job = Training(micro_batch=1, seq_len=64, implementation="hf", compile=compile_mode)  # type: ignore[arg-type]
    assert compiles_sharded(job, parallel) is covered


def test_compiled_data_parallel_refusal_names_what_is_covered() -> None:
    job = Training(micro_batch=2, seq_len=64, implementation="hf", compile="regional")
    with pytest.raises(NotImplementedError, match="under FSDP2 alone"):
        calc.estimate(_spec(), job, parallel=calc.Parallelism(dp=2), device="cpu")


def test_the_planner_refuses_a_compiled_base_job_by_name() -> None:
    from calc.plan import planner

    base = Training(micro_batch=1, seq_len=64, compile="default")
    with pytest.raises(ValueError, match=r"base\.compile='default'"):
        planner.plan(
            _spec(), task="full-finetune", seq_len=64, global_batch=1, gpu="h100-80gb", base=base
        )
