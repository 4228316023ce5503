"""torchtune's Llama (`calc.models.torchtune`): its buffers by hand, and what it refuses. The
whole step is checked against the CPU tracker by the ``tt-*`` verify cases (torchtune's model
code, copied in verify/models/torchtune_llama.py and compared with the library in
tests/verify/models/test_torchtune_llama.py)."""

from __future__ import annotations

import pytest

import calc
from calc.plan.planner import plan
from tests.specs import tiny_llama

JOB = {"micro_batch": 1, "seq_len": 8, "precision": "fp32", "implementation": "torchtune",
       "loop": "del-logits"}  # fmt: skip


def _estimate(model: calc.ModelSpec | None = None, **kw: object) -> calc.Estimate:
    job = calc.Training(**{**JOB, **kw})  # type: ignore[arg-type]
    return calc.estimate(model or tiny_llama(), job, device="cpu")


def test_rope_buffers_are_fp32_over_max_positions() -> None:
    # One RoPE module shared by the layers: theta [d/2] fp32 = 4 * 4 B -> one 512-B block, and
    # cache [max_positions, d/2, 2] fp32 = 64 * 8 * 4 = 2,048 B (tiny llama: d = 8, P = 64).
    assert _estimate().breakdown["buffers"] == 512 + 2048
    # P = 1024: 1024 * 8 * 4 = 32,768 B; the buffers live through the whole step, in bf16 too
    long = _estimate(tiny_llama(max_positions=1024), precision="bf16")
    assert long.breakdown["buffers"] == 512 + 32768
    short = _estimate(precision="bf16")
    assert long.peak_bytes - short.peak_bytes == 32768 - 2048


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"precision": "amp-bf16"}, "autocast"),
        ({"loop": "drop-output"}, "loop='drop-output'"),
        ({"loss": "sum"}, "loss='sum'"),
        ({"recompute": "selective"}, "whole layers"),
        ({"attention": "eager"}, "'eager'"),
    ],
)
def test_refuses_what_torchtune_does_not_run(change: dict, words: str) -> None:
    with pytest.raises(NotImplementedError, match=words):
        _estimate(**change)


def test_refuses_q_k_norms() -> None:
    with pytest.raises(NotImplementedError, match="q/k norms"):
        _estimate(tiny_llama(model_type="qwen3", qk_norm=True))


def test_implementation_is_validated_by_name() -> None:
    with pytest.raises(ValueError, match="implementation"):
        calc.Training(micro_batch=1, seq_len=8, implementation="torchtitan-x")  # type: ignore[arg-type]


def test_planner_tables_count_the_rope_cache() -> None:
    # The planner evaluates its tables at the model's dimensions, where max_positions is 0 for
    # RoPE models: torchtune's cache (4096 * 8 * 4 B here) must still be in its peak.
    model = tiny_llama(n_layers=4, max_positions=4096)
    job = calc.Training(**{**JOB, "precision": "bf16"})  # type: ignore[arg-type]
    fixed = {"precision": "bf16", "recompute": "none", "optimizer": "adamw", "attention": "sdpa"}
    best = plan(model, task="full-finetune", seq_len=8, global_batch=1, gpu="h100-80gb",
                base=job, fixed=fixed, error_bars=False).best  # fmt: skip
    assert best is not None and best.config.job.implementation == "torchtune"
    assert best.peak_bytes == calc.estimate(model, job).peak_bytes


def _rounded(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def _adam_bytes(model: calc.ModelSpec, rank: int, ranks: int) -> int:
    """Two fp32 Adam states of every LoRA adapter, each its own storage in 512-B blocks: A
    [rank, in], B [out, rank] per decoder linear; under FSDP2 over ``ranks`` ranks the dim-0
    shard of each (``ceil(dim0 / ranks)`` rows)."""
    h, kd, f = model.hidden, model.n_kv_heads * model.head_dim, model.ffn
    qd = model.n_heads * model.head_dim
    linears = [(qd, h), (kd, h), (kd, h), (h, qd), (f, h), (h, f), (f, h)]  # (out, in)
    per_layer = 0
    for out_f, in_f in linears:
        per_layer += _rounded(-(-rank // ranks) * in_f * 4) + _rounded(
            -(-out_f // ranks) * rank * 4
        )
    return 2 * per_layer * model.n_layers


def test_lora_trains_the_adapters_alone_on_one_gpu_and_sharded_under_fsdp2() -> None:
    # torchtune's LoRALinear on every decoder linear: the optimizer holds the adapters' states
    # only; the distributed recipe shards each adapter on dim 0 like any parameter.
    model = tiny_llama(hidden=64, n_heads=4, head_dim=16, ffn=128, vocab=64)
    job = calc.Training(**{**JOB, "lora": calc.LoRA(rank=8)})  # type: ignore[arg-type]
    one = calc.estimate(model, job, device="cpu")
    assert one.breakdown["optimizer"] == _adam_bytes(model, 8, 1)
    fsdp = calc.estimate(model, job, calc.Parallelism(dp=2, fsdp=True), device="cpu")
    assert fsdp.breakdown["optimizer"] == _adam_bytes(model, 8, 2)
    assert _adam_bytes(model, 8, 2) < _adam_bytes(model, 8, 1)


@pytest.mark.parametrize(
    ("parallel", "words"),
    [
        (calc.Parallelism(dp=2), "fsdp=True"),
        (calc.Parallelism(dp=2, fsdp=True, fsdp_param_dtype="bf16"), "fsdp_param_dtype"),
        (calc.Parallelism(dp=2, fsdp=True, offload="optimizer"), "offload"),
    ],
)
def test_data_parallelism_is_the_distributed_recipes_fsdp2(
    parallel: calc.Parallelism, words: str
) -> None:
    with pytest.raises(NotImplementedError, match=words):
        calc.estimate(tiny_llama(), calc.Training(**JOB), parallel, device="cpu")  # type: ignore[arg-type]


# ------------------------------------------------------------------ activation offloading


def _offload_job(**changes: object) -> calc.Training:
    fields: dict = {"micro_batch": 2, "seq_len": 128, "precision": "bf16",
                    "implementation": "torchtune", "loop": "del-logits", "recompute": "full",
                    "offload_activations": True}  # fmt: skip
    return calc.Training(**{**fields, **changes})  # type: ignore[arg-type]


def test_offloading_frees_every_layer_input_the_forward_held() -> None:
    # The forward's peak falls at the head (a vocabulary of 8,192). Without offloading every
    # checkpoint frame still holds its layer's input there: L x b x s x h x 2 B. With it, the
    # inputs went to the host: the forward stash then holds only the final norm's own saves
    # (the last five pack ids), which autograd would keep anyway.
    model = tiny_llama(vocab=8192, n_layers=4)
    off = calc.estimate(model, _offload_job(), device="cpu")
    plain = calc.estimate(model, _offload_job(offload_activations=False), device="cpu")
    layer_input = 2 * 128 * model.hidden * 2
    assert plain.phases["step2/forward"] - off.phases["step2/forward"] == 4 * layer_input


def test_offloading_needs_the_recipes_checkpointing() -> None:
    with pytest.raises(ValueError, match="offload_activations=True needs recompute='full'"):
        _offload_job(recompute="none")


def test_offloading_is_refused_by_name_where_not_modelled() -> None:
    model = tiny_llama(vocab=8192)
    with pytest.raises(NotImplementedError, match="with implementation='reference'"):
        calc.estimate(model, _offload_job(implementation="reference", loop="drop-output"))
    with pytest.raises(NotImplementedError, match="= 128 tokens: modelled from 256"):
        calc.estimate(model, _offload_job(seq_len=64))
