"""The planner on 2+ GPUs: rows evaluated from rank-class tables equal `calc.estimate`.

`calc.plan` evaluates a multi-GPU training grid per (layout, structure) and class of ranks from
persisted tables (`calc.plan.grid`, `calc.plan.grid_eval.grid_peaks` with DDP's buckets as per-step
extras); `calc.estimate(model, job, parallel)` replays each configuration through sympy's
lambdify (`calc.estimate.ranks`): an independent evaluation path. Every row must agree exactly, for
every layout, on CUDA and under the CPU tracker. Tiny model as in tests/calc/plan/test_planner.py (llama,
h=16, L=2, a=k=2, d=8, f=24, V=50).
"""

from __future__ import annotations

import numpy as np
import pytest

import calc
from calc.data.gpus import GPU
from calc.plan import grid as plan_grid
from calc.plan import grid_eval as E
from calc.plan import planner as P
from calc.plan.layouts import layouts
from calc.plan.program import to_program
from tests.specs import tiny_llama, tiny_llama64

TINY = tiny_llama()
BASE = calc.Training(micro_batch=1, seq_len=8, implementation="reference")
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setenv("VRAMPLAN_CACHE_DIR", str(tmp_path))
    plan_grid.clear_memory_cache()
    yield
    plan_grid.clear_memory_cache()


def _gpu(usable_bytes: int) -> GPU:
    return GPU(
        id="test-gpu", name="test", vendor="nvidia", marketed="test",
        total_bytes=usable_bytes + MIB, reserved_bytes=MIB, source="test",
    )  # fmt: skip


def _plan(gpu_count: int, global_batch: int, fixed: dict, device: str = "cuda") -> P.Plan:
    return P.plan(TINY, task="full-finetune", seq_len=8, global_batch=global_batch,
                  gpu=_gpu(1 << 40), gpu_count=gpu_count, fixed=fixed, base=BASE,
                  report={"cases": []}, device=device)  # fmt: skip


def _check_rows(p: P.Plan, device: str) -> set[str]:
    """Every row against calc.estimate: the peak, the phase, and why a row has none."""
    seen = set()
    for e in p.fitting + p.excluded:
        par = e.config.parallel
        assert par is not None
        seen.add(e.config.choices["parallel"])
        if e.peak_bytes is None:  # the estimate refuses it, with the same kind of reason
            err = ValueError if e.reason.startswith("invalid:") else NotImplementedError
            with pytest.raises(err):
                calc.estimate(TINY, e.config.job, par, device)
            continue
        est = calc.estimate(TINY, e.config.job, par, device)
        assert e.peak_bytes == est.peak_bytes, (e.config.choices, e.config.grad_accum)
        assert e.peak_phase == est.peak_phase
    return seen


def _layouts(gpu_count: int, fp32: bool) -> set[str]:
    """The layouts of ``gpu_count`` GPUs; FSDP2's mixed-precision policy (``fsdp-mp``) only
    with precision fp32 in the grid."""
    return {x for x in layouts(gpu_count) if fp32 or "-fsdp-mp" not in x}


@pytest.mark.parametrize(
    ("device", "fixed"),
    [
        ("cuda", {"precision": ("fp32", "amp-bf16"), "optimizer": ("adamw",),
                  "recompute": ("none", "full")}),
        ("cpu", {"precision": ("bf16",), "optimizer": ("sgd", "adamw"), "recompute": ("none",)}),
    ],
)  # fmt: skip
def test_every_two_gpu_row_equals_estimate(device: str, fixed: dict) -> None:
    # 7 layouts (DDP, ZeRO-1/2/3, FSDP2, ZeRO-3 + offload, tp2), 8 with FSDP2's bf16/fp32
    # policy where precision fp32 is in the grid, x 4 combinations of the fixed axes x
    # micro-batches {1, 2, 4} of the per-GPU batch 4 (grad_accum 4, 2, 1)
    p = _plan(2, 8, fixed, device)
    combos = 1
    for values in fixed.values():
        combos *= len(values)
    fp32 = "fp32" in fixed["precision"]
    assert p.n_configurations == (8 if fp32 else 7) * combos * 3
    assert _check_rows(p, device) == _layouts(2, fp32)
    assert p.compiled_now > 0
    # a new process: tables from the persistent cache (memory forgotten), the same rows
    plan_grid.clear_memory_cache()
    again = _plan(2, 8, fixed, device)
    assert again.compiled_now == 0
    assert [(e.config.choices, e.peak_bytes) for e in again.fitting + again.excluded] == [
        (e.config.choices, e.peak_bytes) for e in p.fitting + p.excluded
    ]


def test_every_four_gpu_row_equals_estimate() -> None:
    # 4 GPUs: dp4 x 6 shardings, dp2 x 6 shardings with tp2, and tp4, which does not divide
    # the 2 heads (invalid); bf16 + adamw, recompute none; micro-batches {1, 2} of 2 per GPU
    fixed = {"precision": ("bf16",), "optimizer": ("adamw",), "recompute": ("none",)}
    p = _plan(4, 8, fixed)
    assert p.n_configurations == 13 * 2
    assert _check_rows(p, "cuda") == _layouts(4, fp32=False)
    tp4 = [e for e in p.excluded if e.config.choices["parallel"] == "tp4"]
    assert len(tp4) == 2 and all(e.reason.startswith("invalid:") for e in tp4)


def test_precompile_on_two_gpus_fills_the_cache_for_the_plan() -> None:
    fixed = {"precision": ("bf16",), "optimizer": ("adamw",), "recompute": ("none",)}
    done = P.precompile(TINY, task="full-finetune", seq_len=8, global_batch=4, gpu_count=2,
                        fixed=fixed, base=BASE)  # fmt: skip
    # 7 layouts, one class of ranks each, grad_accum 1 and >= 2; ZeRO-3 is replayed as FSDP2
    # (calc.config.parallelism.rank_classes: sharded parameters), so dp2-zero3 and dp2-fsdp share
    # their tables: 6 x 2 = 12
    assert done == 12
    plan_grid.clear_memory_cache()
    p = _plan(2, 4, fixed)
    assert p.compiled_now == 0 and p.n_configurations == 14
    assert _check_rows(p, "cuda") == _layouts(2, fp32=False)


def test_grid_extras_split_step_one_from_later_by_hand() -> None:
    # Two candidates over one size x = b (bytes): "step1/backward" holds 3x, "step2/backward"
    # holds 4x. Extras 100 B in step 1, 10 B later: peak = max(3b + 100, 4b + 10), so the
    # step-1 candidate wins while 3b + 100 > 4b + 10, i.e. b < 90; at b = 90 both are 370 and
    # the first candidate (step 1) is taken, as np.argmax takes the first.
    b_sym = calc.symbols.b
    table = plan_grid.StructureTable(
        programs=(to_program(b_sym),), c0=np.array([[3], [4]]), c1=np.array([[0], [0]]),
        phases=("step1/backward", "step2/backward"),
    )  # fmt: skip
    job = calc.Training(micro_batch=1, seq_len=8)
    # 300 points: beyond plan_eval.PRUNE_MIN_POINTS, so dominance pruning runs (within steps)
    b = np.arange(1, 301)
    got = E.grid_peaks(TINY, job, b, np.full_like(b, 8), device="cpu", table=table,
                       extras=(100, 10))  # fmt: skip
    want = np.maximum(3 * b + 100, 4 * b + 10)
    assert np.array_equal(got.peak_bytes, want)
    phase = np.array(got.phases)[got.phase_index]
    assert set(phase[b <= 90]) == {"step1/backward"} and set(phase[b > 90]) == {"step2/backward"}
    # without extras the later candidate dominates everywhere: 4b
    plain = E.grid_peaks(TINY, job, b, np.full_like(b, 8), device="cpu", table=table)
    assert np.array_equal(plain.peak_bytes, 4 * b)


def test_rank_tables_survive_the_json_round_trip() -> None:
    from calc.estimate.ranks import rank_replays

    job = calc.Training(micro_batch=2, seq_len=8, precision="bf16", optimizer="adamw",
                        implementation="reference")  # fmt: skip
    (rr,) = rank_replays(TINY, job, calc.Parallelism(dp=2), "cuda")
    table, fresh = plan_grid.structure_table(rr.model, rr.job, "cuda", opts=rr.options)
    assert fresh and table.grad_order  # DDP's gradient order is part of the table
    back = plan_grid.StructureTable.from_json(table.to_json())
    assert back.grad_order == table.grad_order and back.phases == table.phases
    # the grad order's numels: one entry per parameter of the two replayed layers and the rest
    numels = E.grad_numels(back, rr.model)
    assert numels is not None
    # llama parameters: embed V*h = 800, per layer 2 norms (16 each), q/k/v/o 4 x 256,
    # gate/up/down 3 x 384, final norm 16, head 800: 800 + 2 x (32 + 1024 + 1152) + 16 + 800
    assert sum(n for _, n, _ in numels) == 800 + 2 * (32 + 1024 + 1152) + 16 + 800
    # a different replay option is a different table (and cache entry)
    (z3,) = rank_replays(TINY, job, calc.Parallelism(dp=2, zero=3), "cuda")
    assert plan_grid.structure_id(z3.model, z3.job, z3.options) != plan_grid.structure_id(
        rr.model, rr.job, rr.options
    )


def test_layouts_with_several_rank_classes_take_the_most_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from calc.estimate.ranks import rank_replays
    from calc.plan import axes as plan_axes
    from calc.plan import layouts as plan_layouts

    # ZeroRedundancyOptimizer's by-parameter partition (not enumerated by default): each dp
    # rank owns other parameters' states, so the two dp ranks are two classes of ranks
    by_param = calc.Parallelism(dp=2, zero=1, zero_partition="by-parameter")
    table = {"dp2-zero1-by-parameter": by_param, "dp2-zero0": calc.Parallelism(dp=2)}
    monkeypatch.setattr(plan_layouts, "layouts", lambda n: table)
    monkeypatch.setattr(plan_axes, "layouts", lambda n: table)
    job = calc.Training(micro_batch=1, seq_len=8, precision="fp32", optimizer="adamw")
    assert len(rank_replays(TINY, job, by_param, "cuda")) == 2
    fixed = {"precision": ("fp32", "bf16"), "optimizer": ("adamw",), "recompute": ("none",)}
    p = _plan(2, 4, fixed)
    assert p.n_configurations == 2 * 2 * 2
    rows = p.fitting + p.excluded
    for e in rows:
        est = calc.estimate(TINY, e.config.job, e.config.parallel)
        assert e.peak_bytes == est.peak_bytes and e.peak_phase == est.peak_phase
    # the peaks of the two classes differ (else the maximum would not be exercised)
    one = next(e for e in rows if e.config.choices["parallel"] == "dp2-zero1-by-parameter")
    est = calc.estimate(TINY, one.config.job, by_param)
    assert len(set(est.rank_peaks.values())) == 2


QUANTISABLE = tiny_llama64(name="tiny-llama-64")
"""TINY with every linear a multiple of nf4's smallest block (64), so QLoRA applies."""


@pytest.mark.parametrize("task", ["lora", "qlora"])
def test_lora_and_qlora_rows_on_two_gpus_equal_estimate(task: str) -> None:
    # Adapters on 2 GPUs: the layouts calc.estimate models with adapters (DDP; FSDP2/ZeRO-3
    # for LoRA) come from the vectorised rank tables, the others say "not modelled" as
    # calc.estimate does; every peak equals calc.estimate's.
    base = calc.Training(micro_batch=1, seq_len=8, implementation="reference", precision="bf16")
    fixed = {"optimizer": ("adamw",), "recompute": ("none",)}
    p = P.plan(QUANTISABLE, task=task, seq_len=8, global_batch=4, gpu=_gpu(1 << 40),
               gpu_count=2, fixed=fixed, base=base, report={"cases": []})  # fmt: skip
    modelled = set()
    for e in p.fitting + p.excluded:
        par = e.config.parallel
        if e.peak_bytes is None:
            err = ValueError if e.reason.startswith("invalid:") else NotImplementedError
            with pytest.raises(err):
                calc.estimate(QUANTISABLE, e.config.job, par)
            continue
        modelled.add(e.config.choices["parallel"])
        est = calc.estimate(QUANTISABLE, e.config.job, par)
        assert e.peak_bytes == est.peak_bytes and e.peak_phase == est.peak_phase
        assert e.config.job.lora is not None
    assert "dp2-zero0" in modelled
    if task == "lora":
        assert {"dp2-fsdp", "dp2-zero3"} <= modelled
    assert p.compiled_now > 0  # from rank tables, not one calc.estimate per row


def test_sixteen_gpus_add_hsdp_rows_that_equal_estimate() -> None:
    # 16 GPUs, no tp: besides FSDP2 over all 16, HSDP over two nodes of 8 (sharded within a
    # node, replicated across the two), alone and with the recipes' bf16/fp32 policy; each row
    # equals calc.estimate
    hsdp = ("dp16-fsdp", "dp16-hsdp8", "dp16-hsdp8-mp")
    assert all(x in layouts(16) for x in hsdp)
    assert layouts(16)["dp16-hsdp8"].dp_replicate == 2
    assert not any("hsdp" in x for x in layouts(8))  # one node: FSDP2 is the node
    fixed = {"parallel": hsdp, "precision": ("fp32",), "optimizer": ("adamw",),
             "recompute": ("none",)}  # fmt: skip
    p = _plan(16, 16, fixed)
    assert _check_rows(p, "cuda") == set(hsdp)


def test_hsdp_over_nodes_of_eight_holds_an_eighth_of_the_states() -> None:
    # Llama-2-7B (6.74e9 parameters), fp32 with AdamW: at the peak (step 2's backward) a GPU
    # keeps its shard of the weights and both moments, 12 bytes a parameter, and of the
    # gradients those reduce-scattered so far, up to 4 more. FSDP2 over 16 GPUs holds 1/16
    # of it, HSDP over two nodes of 8 holds 1/8: the difference is between 12 / 16 and
    # 16 / 16 bytes a parameter, the rest (a layer's gathered weights, the activations) equal
    model = calc.load_card("llama-2-7b")
    job = calc.Training(micro_batch=1, seq_len=512, precision="fp32", optimizer="adamw")
    fsdp = calc.estimate(model, job, layouts(16)["dp16-fsdp"]).peak_bytes
    hsdp = calc.estimate(model, job, layouts(16)["dp16-hsdp8"]).peak_bytes
    assert 12 * model.n_params / 16 <= hsdp - fsdp <= 16 * model.n_params / 16
