"""`calc.plan`: the grid, the ranking, the reasons, least hardware and what to change.

Expected counts and scores are derived by hand in the comments; peaks are checked against
`calc.estimate` (the symbolic replay compiled with sympy's lambdify, an independent evaluation
path from the planner's integer programs). Tiny model as in tests/calc/estimate/test_terms.py:
llama, h=16, L=2, a=k=2, d=8, f=24, V=50.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import calc
from calc.data import outside
from calc.data.gpus import GPU
from calc.plan import planner as P
from calc.plan.throughput import layer_matmul_params, recompute_factor, throughput_proxy
from tests.specs import tiny_llama

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")


TINY = tiny_llama()
BASE = calc.Training(micro_batch=1, seq_len=8, implementation="reference")
FIXED = {
    "precision": ("fp32", "bf16"),
    "optimizer": ("sgd", "adamw"),
    "recompute": ("none", "full"),
}
MIB = 1 << 20


def _gpu(usable_bytes: int) -> GPU:
    return GPU(
        id="test-gpu", name="test", vendor="nvidia", marketed="test",
        total_bytes=usable_bytes + MIB, reserved_bytes=MIB, source="test",
    )  # fmt: skip


NCCL_ONE = 1638 * MIB
"""One NCCL communicator's upper end, about 1.6 GB (NVIDIA/nccl issue #864): every layout on
2 GPUs has one (its data-, tensor- or pipeline-parallel group), charged on every rank."""


def _gpu2(usable_bytes: int) -> GPU:
    """A GPU on which each rank of a 2-GPU layout may use ``usable_bytes``."""
    return _gpu(usable_bytes + NCCL_ONE)


def _plan(usable: int, **kw: object) -> P.Plan:
    args = dict(task="full-finetune", seq_len=8, global_batch=4, gpu=_gpu(usable), fixed=FIXED,
                base=BASE, report={"cases": []})  # fmt: skip
    args.update(kw)
    return P.plan(TINY, **args)  # type: ignore[arg-type]


def _peak(job: calc.Training | calc.Inference, model: calc.ModelSpec = TINY) -> int:
    return int(calc.estimate(model, job).peak_bytes)


def test_grid_enumerates_every_combination() -> None:
    p = _plan(1 << 40)
    # 2 precisions x 2 optimizers x 2 recompute x micro-batches {1, 2, 4} (divisors of 4) = 24
    assert p.n_configurations == 24
    assert len(p.fitting) == 24 and not p.excluded  # 1 TiB holds a 2-layer toy
    pairs = {(e.config.job.micro_batch, e.config.grad_accum) for e in p.fitting}
    # global batch 4 on 1 GPU: micro-batch x accumulation = 4
    assert pairs == {(1, 4), (2, 2), (4, 1)}
    combos = {(e.config.choices["precision"], e.config.choices["optimizer"],
               e.config.choices["recompute"]) for e in p.fitting}  # fmt: skip
    assert combos == set(itertools.product(*FIXED.values()))


def test_every_fitting_config_fits_and_every_excluded_one_does_not() -> None:
    everything = _plan(1 << 40)
    peaks = sorted(e.peak_bytes for e in everything.fitting)
    usable = peaks[len(peaks) // 2]  # a GPU that holds about half of the grid
    p = _plan(usable)
    assert p.fitting and p.excluded
    for e in p.fitting:
        assert e.peak_bytes == _peak(e.config.job) <= usable
        assert e.headroom_bytes == usable - e.peak_bytes
    for e in p.excluded:
        assert e.peak_bytes == _peak(e.config.job) > usable
        assert e.reason  # why it is excluded
    # ranked by the proxy, then headroom (both descending)
    keys = [(-e.throughput_proxy, -e.headroom_bytes) for e in p.fitting]
    assert keys == sorted(keys)
    by_headroom = [e.headroom_bytes for e in p.ranked("headroom")]
    assert by_headroom == sorted(by_headroom, reverse=True)
    # closest to fitting first among the excluded
    missing = [-e.headroom_bytes for e in p.excluded]
    assert missing == sorted(missing)


def test_fit_boundary_is_inclusive() -> None:
    job = calc.Training(micro_batch=2, seq_len=8, precision="bf16", optimizer="adamw",
                        grad_accum=2, implementation="reference")  # fmt: skip
    peak = _peak(job)
    assert P.evaluate(TINY, job, gpu=_gpu(peak), report={}).fits
    short = P.evaluate(TINY, job, gpu=_gpu(peak - 1), report={})
    assert not short.fits and short.headroom_bytes == -1 and short.peak_bytes == peak


def test_not_modelled_and_invalid_configurations_say_why() -> None:
    p = _plan(1 << 40, base=calc.Training(micro_batch=1, seq_len=8, implementation="hf"),
              fixed={**FIXED, "recompute": ("selective",), "optimizer": ("adafactor",),
                     "optimizer_impl": ("fused", "foreach")})  # fmt: skip
    assert not p.fitting
    reasons = {e.config.choices["optimizer_impl"]: e.reason for e in p.excluded}
    # fused adafactor does not exist in PyTorch: calc.Training rejects it
    assert reasons["fused"].startswith("invalid:") and "fused" in reasons["fused"]
    # HF selective recompute is not modelled: calc.estimate raises, the plan reports it
    assert reasons["foreach"].startswith("not modelled:")
    bad = next(e for e in p.excluded if e.config.choices["optimizer_impl"] == "foreach")
    with pytest.raises(NotImplementedError):
        calc.estimate(TINY, bad.config.job)


def test_training_on_two_gpus_enumerates_layouts_and_matches_estimate() -> None:
    # 2 GPUs: tp 1 (dp 2: DDP, ZeRO-1/2/3, FSDP2, ZeRO-3 + optimizer offload) or tp 2 (dp 1);
    # precision and optimizer held at the base (amp-bf16, adamw); recompute none;
    # micro-batch divides the per-GPU batch 2: {1, 2} -> 7 x 2 = 14 configurations
    p = _plan(1 << 40, gpu_count=2, fixed={"recompute": ("none",)})
    assert p.axes[0] == "parallel" and p.n_configurations == 14 and len(p.fitting) == 14
    labels = {e.config.choices["parallel"] for e in p.fitting}
    assert labels == {"dp2-zero0", "dp2-zero1", "dp2-zero2", "dp2-zero3", "dp2-fsdp",
                      "dp2-zero3-offload", "tp2"}  # fmt: skip
    for e in p.fitting:
        par = e.config.parallel
        assert par is not None and par.dp * par.tp == 2
        job = e.config.job
        assert job.precision == "amp-bf16" and job.optimizer == "adamw"
        # global batch 4 = dp x micro_batch x grad_accum
        assert par.dp * job.micro_batch * job.grad_accum == 4
        assert e.peak_bytes == calc.estimate(TINY, job, par).peak_bytes
    tp = next(e for e in p.fitting if e.config.choices["parallel"] == "tp2")
    assert tp.config.parallel == calc.Parallelism(tp=2)


def test_communication_factor_by_hand() -> None:
    from calc.plan.throughput import communication_factor as cf

    # DDP/ZeRO-1/2 move 2x the parameters, ZeRO-3/FSDP 3x (0.025 each); tp: 0.08 per
    # doubling; offload x 1.3
    assert cf(calc.Parallelism()) == 1.0
    assert cf(calc.Parallelism(dp=4, zero=2)) == pytest.approx(1.05)
    assert cf(calc.Parallelism(dp=4, fsdp=True)) == pytest.approx(1.075)
    assert cf(calc.Parallelism(tp=4)) == pytest.approx(1.16)
    off = calc.Parallelism(dp=2, zero=3, offload="optimizer")
    assert cf(off) == pytest.approx(1.075 * 1.3)


def test_inference_plan_and_gpus() -> None:
    # 8 sequences on 2 GPUs: 4 each, served in batches of 1, 2 or 4; 3 precisions -> 9 rows
    p = P.plan(TINY, task="inference", seq_len=16, global_batch=8, gpu=_gpu(1 << 40),
               gpu_count=2, base=calc.Inference(batch=1, context=16, implementation="reference"),
               report={"cases": []})  # fmt: skip
    assert p.n_configurations == 9 and len(p.fitting) == 9
    for e in p.fitting:
        assert e.peak_bytes == _peak(e.config.job)
        assert e.config.job.context == 16 and e.config.job.batch in (1, 2, 4)


def test_throughput_proxy_by_hand() -> None:
    # Per token and layer, forward: matmul params q,k,v,o 4 x 16*16 = 1024 and gate, up, down
    # 3 x 16*24 = 1152 -> 2 x 2176 = 4352 FLOPs; attention core 4 x s*a*d = 4*8*2*8 = 512.
    # Forward per token: 2 layers x 4864 + head 2*16*50 = 1600 -> 11328; training = 3 x 11328.
    full = calc.Training(micro_batch=1, seq_len=8, recompute="full")
    assert recompute_factor(TINY, full) == pytest.approx((33984 + 2 * 4864) / 33984)
    selective = calc.Training(micro_batch=1, seq_len=8, recompute="selective")
    assert recompute_factor(TINY, selective) == pytest.approx((33984 + 2 * 512) / 33984)
    # torchtitan's op policy reruns every other mm (half the 4352) and no attention core
    by_op = calc.Training(micro_batch=1, seq_len=8, recompute="op")
    assert recompute_factor(TINY, by_op) == pytest.approx((33984 + 2 * 2176) / 33984)
    none = calc.Training(micro_batch=3, seq_len=8)
    # 24 tokens per micro-batch: 24 / (24 + 1024)
    assert throughput_proxy(TINY, none) == pytest.approx(24 / 1048)
    assert throughput_proxy(TINY, full) == pytest.approx((8 / 1032) / (43712 / 33984))
    # LoRA: frozen base, no weight gradients: a step is 2 x 11328 = 22656 per token
    lora_full = calc.Training(micro_batch=1, seq_len=8, recompute="full", lora=calc.LoRA(rank=4))
    assert recompute_factor(TINY, lora_full) == pytest.approx((22656 + 2 * 4864) / 22656)


def test_changes_to_fit_fit_when_re_estimated() -> None:
    job = calc.Training(micro_batch=4, seq_len=8, precision="fp32", optimizer="adamw",
                        implementation="reference")  # fmt: skip
    # a GPU 40 KiB short of the job: some single changes fit (a smaller micro-batch), others
    # not (full recomputation alone saves less on this tiny model)
    usable = _peak(job) - 40 * 1024
    assert _peak(job) > usable
    gpu = _gpu(usable)
    knobs = ("precision", "recompute", "micro_batch")  # a small grid keeps the test short
    changes = P.changes_to_fit(TINY, job, gpu=gpu, report={}, knobs=knobs)
    assert changes
    sizes = [len(c.changes) for c in changes]
    assert sizes == sorted(sizes)  # one knob before pairs
    singles_fit = set()
    for c in changes:
        new = c.evaluated.config.job
        assert _peak(new) == c.evaluated.peak_bytes <= usable
        for axis in ("precision", "optimizer", "recompute", "optimizer_impl", "attention"):
            if axis in c.changes:
                assert c.changes[axis] == (getattr(job, axis), getattr(new, axis))
            else:
                assert getattr(new, axis) == getattr(job, axis)
        # the global batch is kept: micro-batch x accumulation = 4
        assert new.micro_batch * new.grad_accum == 4
        if len(c.changes) == 1:
            singles_fit.add(next(iter(c.changes.items())))
    for c in changes:
        if len(c.changes) == 2:  # a pair only when neither change fits alone
            for axis, (_, value) in c.changes.items():
                single = P.evaluate(TINY, _with(job, axis, value), gpu=gpu, report={})
                assert not single.fits
    # already fitting: nothing to change
    assert P.changes_to_fit(TINY, job, gpu=_gpu(1 << 40), report={}) == ()
    with pytest.raises(ValueError, match="knobs"):
        P.changes_to_fit(TINY, job, gpu=gpu, report={}, knobs=("implementation",))


def _with(job: calc.Training, axis: str, value: object) -> calc.Training:
    from dataclasses import replace

    if axis == "micro_batch":
        return replace(job, micro_batch=value, grad_accum=4 // value)  # type: ignore[operator]
    return replace(job, **{axis: value})


def test_least_hardware() -> None:
    everything = _plan(1 << 40)
    least_peak = min(_peak(e.config.job) for e in everything.fitting)
    lh = P.least_hardware(TINY, task="full-finetune", seq_len=8, global_batch=4,
                          gpu=_gpu(least_peak), fixed=FIXED, base=BASE, report={})  # fmt: skip
    assert lh.min_peak_bytes == least_peak
    assert lh.min_count == 1 and lh.min_count_best is not None
    assert lh.min_count_best.peak_bytes == least_peak  # only that one fits exactly
    catalog = list(calc.data.gpus.gpu_catalog().values())
    assert lh.smallest_gpu is not None and lh.smallest_gpu.usable_bytes >= least_peak
    assert all(
        g.usable_bytes < least_peak
        for g in catalog
        if g.usable_bytes < lh.smallest_gpu.usable_bytes
    )


def test_least_hardware_searches_gpu_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    # One recipe; a GPU one byte smaller than its least single-GPU peak: 1 GPU fails, and on
    # 2 GPUs sharding (ZeRO/FSDP/offload) takes some per-rank bytes off, so 2 is the least.
    # NCCL's buffers (a constant per communicator, tests/calc/data/test_outside.py) set to 0:
    # on a GPU this small they alone would refuse every layout.
    monkeypatch.setattr(outside, "NCCL_COMMUNICATOR_LOW_BYTES", 0)
    monkeypatch.setattr(outside, "NCCL_COMMUNICATOR_HIGH_BYTES", 0)
    fixed = {"precision": ("bf16",), "optimizer": ("adamw",), "recompute": ("none",)}
    one = _plan(1 << 40, fixed=fixed)
    least_one = min(e.peak_bytes for e in one.fitting)
    lh = P.least_hardware(TINY, task="full-finetune", seq_len=8, global_batch=4,
                          gpu=_gpu(least_one - 1), fixed=fixed, base=BASE, report={})  # fmt: skip
    assert lh.min_count == 2 and lh.min_count_best is not None
    best = lh.min_count_best
    assert best.config.gpu_count == 2 and best.config.parallel is not None
    assert calc.estimate(TINY, best.config.job, best.config.parallel).peak_bytes == best.peak_bytes
    assert best.peak_bytes <= least_one - 1


def test_error_bar_comes_from_the_nearest_verified_cases() -> None:
    # Three training cases: two share implementation, precision, optimizer, recompute with
    # the job (errors 0.5 % and -1.2 %), one shares only the implementation (3.0 %).
    def case(name: str, err: float, **job: object) -> dict:
        return {"name": name, "kind": "training", "error_pct": err, "device": "cpu",
                "job": job, "spec": {"model_type": "llama"}}  # fmt: skip

    near = dict(implementation="reference", precision="bf16", optimizer="adamw", recompute="none")
    report = {"cases": [
        case("a", 0.5, **near), case("b", -1.2, **near),
        case("c", 3.0, implementation="reference", precision="fp32", optimizer="sgd", recompute="full"),
        {"name": "nm", "kind": "training", "error_pct": None, "job": near},  # not compared
    ]}  # fmt: skip
    job = calc.Training(micro_batch=1, seq_len=8, precision="bf16", optimizer="adamw",
                        implementation="reference")  # fmt: skip
    ev = P.evaluate(TINY, job, gpu=_gpu(1 << 40), report=report)
    assert ev.error_bar is not None
    assert ev.error_bar.max_abs_error_pct == pytest.approx(1.2)
    assert set(ev.error_bar.cases) == {"a", "b"}
    assert ev.error_bar.measured_on == "cpu"
    # no case of the job's kind: no error bar
    infer = calc.Inference(batch=1, context=8, implementation="reference")
    assert P.evaluate(TINY, infer, gpu=_gpu(1 << 40), report=report).error_bar is None


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"task": "finetune"}, "task"),
        ({"gpu": "h300"}, "gpu"),
        ({"global_batch": 0}, "global_batch"),
        ({"global_batch": 3, "gpu_count": 2}, "global_batch"),
        ({"seq_len": -1}, "seq_len"),
        ({"fixed": {"zero_stage": 3}}, "zero_stage"),
        ({"fixed": {"precision": "fp8"}}, "precision"),
        ({"fixed": {"micro_batch": 3}}, "micro_batch"),  # 3 does not divide 4
        ({"rank_by": "speed"}, "rank_by"),
        ({"device": "tpu"}, "device"),
        ({"base": calc.Inference(batch=1, context=8)}, "base"),
    ],
)
def test_bad_input_names_the_field(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _plan(1 << 40, **changes)


# TINY with h=64, d=32, f=128: nf4's blocks of 64 divide every quantized linear's input width
TINY64 = tiny_llama(hidden=64, head_dim=32, ffn=128)
ONE_RECIPE = {"optimizer": ("adamw",), "recompute": ("none",)}


@pytest.mark.parametrize("task", ["lora", "qlora"])
def test_lora_and_qlora_plans_match_estimate(task: str) -> None:
    p = P.plan(TINY64, task=task, seq_len=8, global_batch=2, gpu=_gpu(1 << 40), fixed=ONE_RECIPE,
               base=BASE, report={"cases": []})  # fmt: skip
    # 5 precisions x micro-batch 1, 2
    assert p.n_configurations == 10
    for e in p.fitting + p.excluded:
        job = e.config.job
        assert job.lora == calc.LoRA(rank=16)
        assert job.quant == (calc.Quant(method="nf4") if task == "qlora" else None)
        if e.modelled:
            assert e.peak_bytes == _peak(job, TINY64)
    if task == "lora":
        assert len(p.fitting) == 10
    else:  # a quantized base under autocast is not modelled (calc.step.training._compress)
        reasons = [e.reason for e in p.excluded]
        assert len(reasons) == 4 and all("quantized base" in r for r in reasons)


def test_qlora_base_is_smaller_than_lora_base() -> None:
    # Same recipe; nf4 stores 4 bits (plus one absmax per 64) for the 16-bit weights of
    # q,k,v,o (4 x 64*64) and gate, up, down (3 x 64*128) per layer: the peak drops.
    fixed = {**ONE_RECIPE, "precision": ("bf16",), "micro_batch": (1,)}
    peaks = [
        P.plan(TINY64, task=t, seq_len=8, global_batch=1, gpu=_gpu(1 << 40), fixed=fixed,
               base=BASE, report={"cases": []}).fitting[0].peak_bytes
        for t in ("lora", "qlora")
    ]  # fmt: skip
    assert peaks[1] < peaks[0]


@pytest.mark.parametrize("gpu_count", [1, 2])
def test_torchtune_qlora_plans_match_estimate(gpu_count: int) -> None:
    # torchao's quantization-factor storage is a Piecewise of the size (one scaler block or
    # more, calc.compress.nf4_torchao): the planner's integer programs evaluate it; on 2 GPUs
    # the FSDP2 layouts shard the NF4 weights (hidden 512, k/v 128 x 512: 4 factor entries)
    from verify.cases.scale import scaled_spec

    model = scaled_spec("llama-3.1-8b", kv_heads=4, head_dim=32)
    base = calc.Training(micro_batch=1, seq_len=8, precision="bf16", implementation="torchtune",
                         loop="del-logits", lora=calc.LoRA(rank=8),
                         quant=calc.Quant(method="nf4"))  # fmt: skip
    p = P.plan(model, task="qlora", seq_len=8, global_batch=2, gpu=_gpu(1 << 40),
               gpu_count=gpu_count, fixed={"recompute": ("none",)}, base=base,
               report={"cases": []})  # fmt: skip
    assert p.fitting
    for e in p.fitting:
        parallel = e.config.parallel if gpu_count > 1 else None
        est = calc.estimate(model, e.config.job, parallel=parallel)
        assert e.peak_bytes == est.peak_bytes
    if gpu_count > 1:
        assert any(e.config.parallel.fsdp for e in p.fitting)


def test_lora_zero_sharded_plans_match_estimate() -> None:
    # DeepSpeed-style ZeRO-1/2 with LoRA and QLoRA (adapters' states split in flat shares) are
    # planned on 2 GPUs, each row equal to calc.estimate
    from verify.cases.scale import scaled_spec

    model = scaled_spec("llama-3.1-8b", kv_heads=4, head_dim=32)
    for quant in (None, calc.Quant(method="nf4")):
        base = calc.Training(micro_batch=1, seq_len=8, precision="bf16",
                             implementation="reference", lora=calc.LoRA(rank=8), quant=quant)  # fmt: skip
        p = P.plan(model, task="qlora" if quant else "lora", seq_len=8, global_batch=2,
                   gpu=_gpu(1 << 40), gpu_count=2, fixed={"recompute": ("none",)}, base=base,
                   report={"cases": []})  # fmt: skip
        zero = [e for e in p.fitting if e.config.parallel.zero in (1, 2)]
        assert sorted(e.config.parallel.zero for e in zero) == [1, 2]
        for e in zero:
            est = calc.estimate(model, e.config.job, parallel=e.config.parallel)
            assert e.peak_bytes == est.peak_bytes


def test_qlora_group_size_that_does_not_divide_is_invalid() -> None:
    # int4's groups of 128 along a row: TINY's q projection has in_features 16
    base = calc.Training(micro_batch=1, seq_len=8, implementation="reference",
                         lora=calc.LoRA(rank=2), quant=calc.Quant(method="int4"))  # fmt: skip
    p = _plan(1 << 40, task="qlora", base=base, fixed={**ONE_RECIPE, "precision": ("bf16",)})
    assert not p.fitting and len(p.excluded) == 3  # micro-batch 1, 2, 4
    assert all(e.reason.startswith("invalid: group_size=128") for e in p.excluded)


def test_task_and_base_must_agree() -> None:
    with pytest.raises(ValueError, match="lora"):
        _plan(1 << 40, base=calc.Training(micro_batch=1, seq_len=8, lora=calc.LoRA(rank=2)))


def test_parallel_precompile_fills_the_cache_for_the_plan() -> None:
    fixed = {"precision": ("bf16",), "optimizer": ("lion",), "recompute": ("none",)}
    # one combination, grad_accum 1 and >= 2: two structures, compiled in two processes
    done = P.precompile(TINY, task="full-finetune", seq_len=8, global_batch=2, fixed=fixed,
                        base=BASE, workers=2)  # fmt: skip
    assert done == 2
    p = _plan(1 << 40, fixed=fixed, global_batch=2)
    assert p.compiled_now == 0 and p.n_configurations == 2


@settings(max_examples=15, deadline=None)
@given(
    # the grid's peaks lie between 64 MiB + 47 KiB and 64 MiB + 220 KiB (64 MiB: the two
    # cuBLAS workspaces); sizes around them split the grid
    usable_kib=st.integers(64 * 1024, 64 * 1024 + 240),
    global_batch=st.sampled_from([1, 2, 4, 6]),
    rank_by=st.sampled_from(["throughput", "headroom"]),
)
def test_property_fit_and_exclusion_agree_with_estimate(
    usable_kib: int, global_batch: int, rank_by: str
) -> None:
    """Any GPU size, any batch: what fits re-estimates under the usable bytes, what is
    excluded over them, and the split is complete."""
    usable = usable_kib * 1024
    p = _plan(usable, global_batch=global_batch, rank_by=rank_by)
    assert len(p.fitting) + len(p.excluded) == p.n_configurations
    for e in p.fitting:
        assert _peak(e.config.job) == e.peak_bytes <= usable
        assert e.config.job.micro_batch * e.config.grad_accum == global_batch
    for e in p.excluded:
        assert _peak(e.config.job) == e.peak_bytes > usable
    if p.fitting:
        assert p.best is p.fitting[0]


def test_evaluate_and_changes_keep_a_layout() -> None:
    job = calc.Training(micro_batch=2, seq_len=8, precision="bf16", optimizer="adamw",
                        implementation="reference")  # fmt: skip
    zero3 = calc.Parallelism(dp=2, zero=3)
    row = P.evaluate(TINY, job, gpu=_gpu(1 << 40), gpu_count=2, parallel="dp2-zero3", report={})
    assert row.config.parallel == zero3
    assert row.peak_bytes == calc.estimate(TINY, job, zero3).peak_bytes
    # one byte short: a change that fits keeps ZeRO-3 over 2 GPUs
    tight = _gpu2(row.peak_bytes - 1)
    changes = P.changes_to_fit(TINY, job, gpu=tight, gpu_count=2, parallel="dp2-zero3",
                               report={}, knobs=("micro_batch", "recompute"))  # fmt: skip
    assert changes  # recomputation or a smaller micro-batch frees activations
    for c in changes:
        cfg = c.evaluated.config
        assert cfg.parallel == zero3 and cfg.job.micro_batch * cfg.job.grad_accum == 2
        assert c.evaluated.peak_bytes == calc.estimate(TINY, cfg.job, zero3).peak_bytes
    with pytest.raises(ValueError, match="parallel"):
        P.evaluate(TINY, job, gpu=tight, gpu_count=2, parallel="dp3", report={})


@settings(max_examples=8, deadline=None)
@given(
    # the 2-GPU peaks of this recipe lie between about 65,600 and 65,720 KiB (64 MiB of them
    # the two cuBLAS workspaces): sizes around them split the layouts
    usable_kib=st.integers(65_600, 65_720),
    global_batch=st.sampled_from([2, 4]),
)
def test_property_two_gpu_split_agrees_with_estimate(usable_kib: int, global_batch: int) -> None:
    usable = usable_kib * 1024
    fixed = {"precision": ("amp-bf16",), "optimizer": ("adamw",), "recompute": ("none",)}
    p = _plan(usable + NCCL_ONE, gpu_count=2, global_batch=global_batch, fixed=fixed)
    assert len(p.fitting) + len(p.excluded) == p.n_configurations
    for e in p.fitting + p.excluded:
        par = e.config.parallel
        assert par is not None and par.dp * par.tp == 2
        assert par.dp * e.config.job.micro_batch * e.config.grad_accum == global_batch
        peak = calc.estimate(TINY, e.config.job, par).peak_bytes
        assert e.peak_bytes == peak and e.fits == (peak <= usable)


def test_inference_weight_and_kv_quant_axes_match_estimate() -> None:
    base = calc.Inference(batch=1, context=16, implementation="reference")
    fixed = {"quant": ("none", "int8", "nf4"), "kv_quant": ("none", "fp8"), "precision": ("bf16",)}
    p = P.plan(TINY64, task="inference", seq_len=16, global_batch=2, gpu=_gpu(1 << 40),
               base=base, report={"cases": []}, fixed=fixed)  # fmt: skip
    # 3 weight formats x 2 KV formats x batches {1, 2}
    assert p.n_configurations == 12 and len(p.fitting) == 12
    for e in p.fitting:
        job, ch = e.config.job, e.config.choices
        assert job.quant == (None if ch["quant"] == "none" else calc.Quant(method=ch["quant"]))
        assert job.kv_quant == (None if ch["kv_quant"] == "none" else ch["kv_quant"])
        assert e.peak_bytes == _peak(job, TINY64)
    # held at the base's value (not enumerated by default), a custom Quant stays as given
    custom = calc.Quant(method="int4", group_size=32)
    held = P.plan(TINY64, task="inference", seq_len=16, global_batch=1, gpu=_gpu(1 << 40),
                  base=calc.Inference(batch=1, context=16, implementation="reference",
                                      quant=custom), report={"cases": []},
                  fixed={"precision": ("bf16",)})  # fmt: skip
    assert {e.config.job.quant for e in held.fitting} == {custom}


def test_changes_to_fit_offer_layouts_on_two_gpus() -> None:
    job = calc.Training(micro_batch=2, seq_len=8, precision="bf16", optimizer="adamw",
                        implementation="reference")  # fmt: skip
    ddp = P.evaluate(TINY, job, gpu=_gpu(1 << 40), gpu_count=2, report={})
    assert ddp.config.parallel == calc.Parallelism(dp=2)  # the default layout: DDP
    changes = P.changes_to_fit(TINY, job, gpu=_gpu2(ddp.peak_bytes - 1), gpu_count=2,
                               report={}, knobs=("parallel", "micro_batch"))  # fmt: skip
    # sharding optimizer states (ZeRO-1 and up) takes bytes off every rank: a layout fits
    assert any(set(c.changes) == {"parallel"} for c in changes)
    for c in changes:
        cfg = c.evaluated.config
        old, new = c.changes.get("parallel", ("dp2-zero0", "dp2-zero0"))
        assert old == "dp2-zero0" and cfg.choices["parallel"] == new
        par = cfg.parallel
        assert par is not None and par.dp * cfg.job.micro_batch * cfg.job.grad_accum == 4
        assert c.evaluated.peak_bytes == calc.estimate(TINY, cfg.job, par).peak_bytes
        assert c.evaluated.peak_bytes <= ddp.peak_bytes - 1


@pytest.mark.parametrize("gpu_count", [1, 2])
def test_planner_charges_the_chosen_gpus_cublas_workspace(gpu_count: int) -> None:
    # PyTorch's CublasHandlePool.cpp: ":4096:2:16:8" = 4096 KiB x 2 + 16 KiB x 8 = 8,519,680 B
    # per workspace before Hopper (an A100 is compute capability 8.0), 4096 KiB x 8 = 32 MiB on
    # Hopper (9.0); a training step has 2 (the forward's thread, autograd's device thread)
    job = calc.Training(micro_batch=1, seq_len=8, precision="bf16", optimizer="adamw",
                        implementation="reference")  # fmt: skip
    a100 = P.evaluate(TINY, job, gpu="a100-80gb", gpu_count=gpu_count, report={})
    h100 = P.evaluate(TINY, job, gpu="h100-80gb", gpu_count=gpu_count, report={})
    assert a100.peak_bytes is not None and h100.peak_bytes is not None
    assert h100.peak_bytes - a100.peak_bytes == 2 * (33_554_432 - 8_519_680)
    par = a100.config.parallel if gpu_count > 1 else None
    assert a100.peak_bytes == calc.estimate(TINY, job, par, gpu="a100-80gb").peak_bytes
    # inference: one handle
    inf = calc.Inference(batch=1, context=8, implementation="reference")
    a, h = (P.evaluate(TINY, inf, gpu=g, report={}).peak_bytes for g in ("a100-80gb", "h100-80gb"))
    assert a is not None and h is not None and h - a == 33_554_432 - 8_519_680


def _tiny_phi3(kv_heads: int = 4) -> calc.ModelSpec:
    return calc.ModelSpec.from_hf_config({
        "model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": kv_heads, "intermediate_size": 128,
        "vocab_size": 512, "max_position_embeddings": 512, "pad_token_id": 0,
    })  # fmt: skip


def test_a_derived_architecture_plans_training_with_its_structural_axes_held() -> None:
    # Every training structure of a derived type (phi3 here) is recorded from transformers'
    # code (seconds each), so its plan holds precision and optimizer at the base job's values
    # on any GPU count (240 structures on one GPU become recompute x accumulation). Each row
    # is calc.estimate of its job; transformers has no selective recomputation.
    phi3 = _tiny_phi3(kv_heads=2)
    base = calc.Training(micro_batch=1, seq_len=64, precision="bf16", optimizer="adamw")
    result = P.plan(phi3, task="full-finetune", seq_len=64, global_batch=2, gpu="h100-80gb",
                    base=base, device="cpu")  # fmt: skip
    assert result.n_configurations == 3 * 2  # recompute none/selective/full x micro-batch 1, 2
    assert {(r.config.job.precision, r.config.job.optimizer) for r in result.fitting} == {
        ("bf16", "adamw")
    }
    assert {r.config.job.recompute for r in result.fitting} == {"none", "full"}
    for row in result.fitting:
        assert row.peak_bytes == calc.estimate(phi3, row.config.job, device="cpu").peak_bytes
    assert {r.reason for r in result.excluded} == {
        "not modelled: transformers has no selective recomputation"
    }
    # fixed still enumerates a held axis when asked: two precisions, twice the rows
    two = P.plan(phi3, task="full-finetune", seq_len=64, global_batch=2, gpu="h100-80gb",
                 base=base, device="cpu", fixed={"precision": ("bf16", "fp32")})  # fmt: skip
    assert two.n_configurations == 2 * 3 * 2


def test_a_derived_architecture_is_planned_for_inference() -> None:
    # An inference grid is one structure per precision and size regime: the planner sweeps it
    # for a derived type, every row's peak the one calc.estimate gives (its sympy replay, not
    # the planner's integer programs). On CUDA, fp32 grouped-query attention runs SDPA's math
    # kernel, which the CPU recording does not stand for: excluded, as calc.estimate refuses it.
    phi3 = _tiny_phi3(kv_heads=2)
    result = P.plan(phi3, task="inference", seq_len=64, global_batch=4, gpu="h100-80gb")
    assert result.n_configurations == 9  # 3 precisions x micro-batches 1, 2, 4
    assert {r.config.job.precision for r in result.fitting} == {"bf16", "fp16"}
    assert len(result.fitting) == 6
    for row in result.fitting:
        expected = calc.estimate(phi3, row.config.job, gpu="h100-80gb").peak_bytes
        assert row.peak_bytes == expected
    for row in result.excluded:
        assert row.config.job.precision == "fp32"
        assert row.reason.startswith("not modelled: fp32 inference")
    least = P.least_hardware(phi3, task="inference", seq_len=64, global_batch=4, gpu="h100-80gb")
    assert least.min_count == 1
    job = calc.Inference(batch=4, context=64, precision="bf16")
    assert P.changes_to_fit(phi3, job, gpu="h100-80gb") == ()  # it fits already


def test_a_derived_training_job_is_evaluated_with_its_proxy() -> None:
    # calc.plan.planner.evaluate (the web calculator's verdict) of a derived training job:
    # recomputation's factor needs one layer's matrix parameters, which a derived type has
    # from transformers' meta-device count. Tiny phi3 (h=64, f=128, 4 heads of 16, 2 layers,
    # untied V=512): qkv_proj 64 x 192, o_proj 64 x 64, gate_up_proj 64 x 256, down_proj
    # 128 x 64 = 40,960; its two norms 128; the final norm's 64 shared by 2 layers: 32.
    phi3 = _tiny_phi3()
    assert layer_matmul_params(phi3) == 40_960 + 128 + 32
    job = calc.Training(micro_batch=2, seq_len=64, recompute="full")
    row = P.evaluate(phi3, job, gpu="h100-80gb")
    assert row.peak_bytes == calc.estimate(phi3, job, gpu="h100-80gb").peak_bytes
    # full recomputation reruns each layer's forward: (3F + R) / 3F, F = L (M + C) + 2 h V,
    # M = 2 x 41,120, C = 4 x 64 x 4 x 16, R = L (M + C); the efficiency of 128 tokens
    m, c = 2 * 41_120, 4 * 64 * 4 * 16
    forward = 2 * (m + c) + 2 * 64 * 512
    factor = (3 * forward + 2 * (m + c)) / (3 * forward)
    assert row.throughput_proxy == pytest.approx(128 / (128 + 1024) / factor)


def test_torchtitan_plans_match_estimate() -> None:
    # torchtitan's model under its FSDP2 units (the embedding, each block, [norm, output]) is
    # planned on 2 GPUs: every fitting row equals calc.estimate; its data parallelism is FSDP2
    # alone (DDP and ZeRO-1/2 rows are not modelled)
    from verify.cases.scale import scaled_spec

    model = scaled_spec("llama-3.1-8b", kv_heads=2)
    base = calc.Training(micro_batch=1, seq_len=8, precision="fp32", implementation="torchtitan",
                         loop="del-logits")  # fmt: skip
    p = P.plan(model, task="full-finetune", seq_len=8, global_batch=2, gpu=_gpu(1 << 40),
               gpu_count=2,
               fixed={"recompute": ("none", "full"), "precision": ("fp32",)}, base=base,
               report={"cases": []})  # fmt: skip
    assert p.fitting
    for e in p.fitting:
        assert e.config.job.implementation == "torchtitan"
        est = calc.estimate(model, e.config.job, parallel=e.config.parallel)
        assert e.peak_bytes == est.peak_bytes
    assert any(e.config.parallel.fsdp for e in p.fitting)


def test_fsdp_mixed_precision_layout_is_planned_for_an_fp32_model() -> None:
    # FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) casts an fp32 model:
    # the grid takes the layout where it takes precision fp32 (each row the estimate of that
    # layout) and refuses it under autocast; without fp32 in the grid the layout is left out
    # (the two-GPU test above: 7 layouts).
    p = _plan(1 << 40, gpu_count=2, fixed={"recompute": ("none",),
                                           "precision": ("fp32", "amp-bf16")})  # fmt: skip
    rows = [e for e in (*p.fitting, *p.excluded) if e.config.choices["parallel"] == "dp2-fsdp-mp"]
    assert len(rows) == 4  # 2 precisions x micro-batches {1, 2}
    mp = calc.Parallelism(dp=2, fsdp=True, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32")
    for e in rows:
        if e.config.job.precision == "fp32":
            assert e.fits and e.peak_bytes == calc.estimate(TINY, e.config.job, mp).peak_bytes
        else:
            assert not e.fits and "fsdp_param_dtype" in e.reason


def test_torchtitan_plans_its_own_recomputations() -> None:
    # torchtitan's apply_ac: whole blocks or by op (no selective attention recomputation)
    base = calc.Training(micro_batch=1, seq_len=8, implementation="torchtitan",
                         loop="del-logits", precision="fp32")  # fmt: skip
    p = _plan(1 << 40, base=base, fixed={"optimizer": ("adamw",)})
    assert {e.config.job.recompute for e in p.fitting} == {"none", "full", "op"}
    with pytest.raises(ValueError, match="allowed: 'none', 'full', 'op'"):
        _plan(1 << 40, base=base, fixed={"recompute": ("selective",)})
