"""Pruning: sparse storage bytes and break-even, 2:4 storage, the torch.nn.utils.prune terms of
the training replay, and structured pruning, on tiny dims with the bytes derived by hand here.

TINY is `tests/calc/estimate/test_terms.py`'s model (llama, h=16, L=2, a=k=2, d=8, f=24, V=50, fp32):
per layer the prunable linears are q, k, v, o [16, 16] = 1024 B each and gate, up, down
(24 x 16) = 1536 B each, all multiples of 512: 4*1024 + 3*1536 = 8704 B per layer, 17408 B
for both layers.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import calc
from calc.compress.sparse import (
    break_even_nnz,
    pruned_nnz,
    semi_structured_bytes,
    sparse_bytes,
    storage_verdict,
)
from calc.config.pruning import Pruning
from tests.specs import tiny_llama

PRUNED_TINY = 17408  # module docstring


_llama = tiny_llama


TINY = _llama()


def _train(**changes: object) -> calc.Training:
    job = dict(micro_batch=1, seq_len=8, precision="fp32", implementation="reference")
    job.update(changes)
    return calc.Training(**job)  # type: ignore[arg-type]


# ------------------------------------------------------------------ sparse storage


def test_csr_and_coo_bytes_by_hand() -> None:
    # 4 x 8 fp32 with 10 non-zeros, int64 indices:
    # CSR: values 10*4 = 40, col_indices 10*8 = 80, crow_indices (4+1)*8 = 40.
    # COO: values 40, indices [2, 10] int64 = 160.
    assert sparse_bytes(4, 8, 10, "csr", 4) == {
        "values": 40,
        "col_indices": 80,
        "crow_indices": 40,
    }
    assert sparse_bytes(4, 8, 10, "coo", 4) == {"values": 40, "indices": 160}
    assert sparse_bytes(4, 8, 10, "dense", 4) == {"values": 128}
    # int32 CSR: col 10*4 = 40, crow 5*4 = 20.
    assert sum(sparse_bytes(4, 8, 10, "csr", 4, "int32").values()) == 40 + 40 + 20
    # COO indices are int64 whatever is asked (torch converts them): still 160.
    assert sparse_bytes(4, 8, 10, "coo", 4, "int32") == {"values": 40, "indices": 160}


def test_break_even_by_hand() -> None:
    # 4 x 8 fp32, dense 128 B. CSR int64: 12*nnz + 40 < 128 -> nnz <= 7 (124 < 128; 8 -> 136).
    assert break_even_nnz(4, 8, "csr", 4) == 7
    # COO int64: 20*nnz < 128 -> nnz <= 6 (120; 7 -> 140).
    assert break_even_nnz(4, 8, "coo", 4) == 6
    # CSR int32: 8*nnz + 20 < 128 -> nnz <= 13 (124; 14 -> 132).
    assert break_even_nnz(4, 8, "csr", 4, "int32") == 13
    # bf16 COO int64: 18*nnz < 64 -> nnz <= 3 (54; 4 -> 72); the same with int32 asked.
    assert break_even_nnz(4, 8, "coo", 2) == 3
    assert break_even_nnz(4, 8, "coo", 2, "int32") == 3
    # 1 x 1 bf16 CSR int64: 2 B dense; crow alone is 16 B: never saves.
    assert break_even_nnz(1, 1, "csr", 2) == -1


def test_pruned_nnz_rounds_like_torch() -> None:
    # round(0.25 * 10) = round(2.5) = 2 (ties to even): 8 left; round(0.35 * 10) = 4: 6 left.
    assert pruned_nnz(10, 0.25) == 8
    assert pruned_nnz(10, 0.35) == 6
    assert pruned_nnz(10, 0.0) == 10 and pruned_nnz(10, 1.0) == 0


def test_semi_structured_bytes_by_hand() -> None:
    # bf16 32 x 64: packed 32*32*2 = 2048, meta int16 32*(64/16)*2 = 256 -> 56.25 % of 4096.
    assert semi_structured_bytes(32, 64, 2) == {"packed": 2048, "meta": 256}
    # fp32 32 x 32 (1:2): packed 32*16*4 = 2048, meta int16 32*(32/8)*2 = 256 -> 56.25 % of 4096.
    assert semi_structured_bytes(32, 32, 4) == {"packed": 2048, "meta": 256}
    # int8 16 x 128: packed 16*64 = 1024, meta int32 16*(128/32)*4 = 256 -> 62.5 % of 2048.
    assert semi_structured_bytes(16, 128, 1) == {"packed": 1024, "meta": 256}
    with pytest.raises(ValueError, match="multiple of 32"):
        semi_structured_bytes(16, 64, 2)


def test_storage_verdict_tiny() -> None:
    # TINY at amount 0.5, fp32, int64. q [16,16]: nnz 128; CSR 512 + 1024 + 17*8=136 -> each
    # tensor rounded: 512 + 1024 + 512 = 2048 > 1024 dense: no saving anywhere; the largest
    # weight (24 x 16 = 384) breaks even for CSR below 12*nnz + 200 < 1536 -> nnz <= 111.
    v = storage_verdict(TINY, Pruning(amount=0.5), 4)
    assert v.dense_bytes == PRUNED_TINY
    assert v.best == "dense"
    assert v.density == Fraction(1, 2)
    assert v.break_even_density["csr"] == Fraction(112, 384)
    # At amount 0.95: q/k/v/o (256 elements): round(243.2) = 243 zeroed, 13 left; gate/up/down
    # (384): round(364.8) = 365 zeroed, 19 left. Every tensor takes at least a 512-byte block:
    # COO q: r(52) + r(208) = 1024 (= dense, no saving); COO gate: r(76) + r(304) = 1024 < 1536.
    # CSR q: r(52) + r(104) + r(136) = 1536; CSR gate: r(76) + r(152) + r(200) = 1536 (= dense).
    v = storage_verdict(TINY, Pruning(amount=0.95), 4)
    assert v.bytes_by_format["coo"] == 2 * (4 * 1024 + 3 * 1024)  # 14336
    assert v.bytes_by_format["csr"] == 2 * (4 * 1536 + 3 * 1536)  # 21504
    assert v.best == "coo"


def test_storage_verdict_large_saves() -> None:
    # One 4096 x 4096 bf16 q_proj-sized weight family at 90 % sparsity: CSR values
    # 0.1*N*2 + col 0.1*N*8 + crow = 1.0*N + ... < 2*N dense: CSR wins; COO 0.1*N*18 = 1.8N
    # also saves but less.
    big = _llama(hidden=4096, n_heads=32, n_kv_heads=32, head_dim=128, ffn=11008, n_layers=1)
    v = storage_verdict(big, Pruning(amount=0.9), 2)
    assert v.best == "csr"
    assert v.bytes_by_format["csr"] < v.bytes_by_format["coo"] < v.dense_bytes


def test_storage_measured_with_torch() -> None:
    """Our byte counts against the tensors torch builds (a measurement, not our code)."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    for rows, cols, dtype, item in ((6, 10, torch.float32, 4), (33, 7, torch.bfloat16, 2)):
        dense = torch.randn(rows, cols, generator=gen).to(dtype)
        dense[torch.rand(rows, cols, generator=gen) < 0.6] = 0
        nnz = int((dense != 0).sum())
        csr = dense.to_sparse_csr()
        got = {
            "values": csr.values().nbytes,
            "col_indices": csr.col_indices().nbytes,
            "crow_indices": csr.crow_indices().nbytes,
        }
        assert got == sparse_bytes(rows, cols, nnz, "csr", item)
        coo = dense.to_sparse().coalesce()
        got = {"values": coo.values().nbytes, "indices": coo.indices().nbytes}
        assert got == sparse_bytes(rows, cols, nnz, "coo", item)
        csr32 = torch.sparse_csr_tensor(
            csr.crow_indices().int(), csr.col_indices().int(), csr.values(), (rows, cols)
        )
        got = {
            "values": csr32.values().nbytes,
            "col_indices": csr32.col_indices().nbytes,
            "crow_indices": csr32.crow_indices().nbytes,
        }
        assert got == sparse_bytes(rows, cols, nnz, "csr", item, "int32")
        coo32 = torch.sparse_coo_tensor(coo.indices().int(), coo.values(), (rows, cols))
        got = {"values": coo32._values().nbytes, "indices": coo32._indices().nbytes}
        assert got == sparse_bytes(rows, cols, nnz, "coo", item, "int32")


def test_semi_structured_measured_with_torch_cpu() -> None:
    """torch's CUTLASS compression runs on CPU (plain tensor ops): its packed/meta sizes."""
    torch = pytest.importorskip("torch")
    from torch.sparse._semi_structured_conversions import (
        sparse_semi_structured_from_dense_cutlass,
    )

    for rows, cols, dtype, item in (
        (32, 64, torch.bfloat16, 2),
        (64, 128, torch.float16, 2),
        (32, 32, torch.float32, 4),
        (16, 128, torch.int8, 1),
    ):
        dense = torch.ones(rows, cols, dtype=dtype)
        dense.view(rows, cols // 4, 4)[:, :, 2:] = 0  # a valid 2:4 pattern
        packed, meta = sparse_semi_structured_from_dense_cutlass(dense)
        assert {"packed": packed.nbytes, "meta": meta.nbytes} == semi_structured_bytes(
            rows, cols, item
        )


def test_torch_prune_mask_dtype_and_count() -> None:
    """torch.nn.utils.prune keeps a mask in the weight's dtype and zeroes round(amount*n)."""
    torch = pytest.importorskip("torch")
    from torch.nn.utils import prune

    lin = torch.nn.Linear(5, 2).to(torch.bfloat16)  # 10 weights
    prune.l1_unstructured(lin, "weight", amount=0.25)
    assert lin.weight_mask.dtype == torch.bfloat16
    assert int(lin.weight_mask.sum()) == pruned_nnz(10, 0.25) == 8
    names = [n for n, _ in lin.named_parameters()]
    assert names == ["bias", "weight_orig"]  # weight_orig re-registered after the bias


# ------------------------------------------------------------------ the training replay


def test_prune_adds_mask_and_product_at_the_optimizer_step() -> None:
    # During the optimizer step the pruned model holds, per pruned weight, the mask buffer and
    # the pre-hook's product besides what an unpruned step holds (weight_orig and its gradient
    # have the sizes of weight and its gradient): + 2 * 17408 at every optimizer event.
    base = calc.estimate(TINY, _train(), device="cpu").phases
    pruned = calc.estimate(TINY, _train(pruning=Pruning()), device="cpu")
    for phase in ("step1/optimizer", "step2/optimizer"):
        assert pruned.phases[phase] - base[phase] == 2 * PRUNED_TINY
    assert pruned.breakdown["pruning/weight_mask"] == PRUNED_TINY
    # 2:4 through prune.custom_from_mask: the hook keeps the caller's mask too (+ 17408 more).
    two4 = calc.estimate(TINY, _train(pruning=Pruning(kind="2:4")), device="cpu").phases
    assert two4["step2/optimizer"] - base["step2/optimizer"] == 3 * PRUNED_TINY


def test_prune_subset_of_modules() -> None:
    # q and v only: 2 * 1024 per layer, 4096 for both layers; mask + product = 8192.
    base = calc.estimate(TINY, _train(), device="cpu").phases
    pruned = calc.estimate(TINY, _train(pruning=Pruning(modules=("q", "v"))), device="cpu")
    assert pruned.phases["step2/optimizer"] - base["step2/optimizer"] == 2 * 4096


def test_prune_removed_is_dense_again() -> None:
    base = calc.estimate(TINY, _train(), device="cpu")
    removed = calc.estimate(TINY, _train(pruning=Pruning(removed=True)), device="cpu")
    assert removed.peak_bytes == base.peak_bytes
    assert removed.phases == base.phases


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_prune_with_recompute_same_optimizer_terms(recompute: str) -> None:
    # The recomputation re-runs the pre-hook, but by the optimizer step every layer again holds
    # one product and one mask: + 2 * 17408 over the recomputed unpruned step.
    base = calc.estimate(TINY, _train(recompute=recompute), device="cpu").phases
    job = _train(pruning=Pruning(), recompute=recompute)
    pruned = calc.estimate(TINY, job, device="cpu").phases
    assert pruned["step2/optimizer"] - base["step2/optimizer"] == 2 * PRUNED_TINY


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "random"}, "kind"),
        ({"amount": 1.5}, "amount"),
        ({"amount": True}, "amount"),
        ({"kind": "2:4", "amount": 0.3}, "amount"),
        ({"modules": ("q", "lm_head")}, "modules"),
        ({"modules": ()}, "modules"),
        ({"modules": ("q", "q")}, "modules"),
        ({"removed": "yes"}, "removed"),
    ],
)
def test_pruning_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Pruning(**kwargs)


def test_pruning_modules_must_exist_in_the_model() -> None:
    with pytest.raises(ValueError, match="qkv"):
        calc.estimate(TINY, _train(pruning=Pruning(modules=("qkv",))), device="cpu")


def test_two_four_needs_input_width_multiple_of_4() -> None:
    # down_proj's input is ffn = 26: not a multiple of 4; q..up take h = 16.
    model = _llama(ffn=26)
    with pytest.raises(ValueError, match="'down'"):
        calc.estimate(model, _train(pruning=Pruning(kind="2:4")), device="cpu")
    job = _train(pruning=Pruning(kind="2:4", modules=("q", "k", "v", "o", "gate", "up")))
    assert calc.estimate(model, job, device="cpu").peak_bytes > 0


# ------------------------------------------------------------------ structured pruning


def test_pruned_spec_params_by_hand() -> None:
    # TINY with a=4, k=2, d=4 (h=16), f=24, L=2, V=50, untied -> keep a=2, k=1, f=8, L=1:
    # q [2*4, 16] = 128, k [4, 16] = 64, v 64, o [16, 8] = 128, gate/up [8, 16] = 128 each,
    # down [16, 8] = 128, 2 norms 32: 800 per layer; embed 800 + final norm 16 + head 800.
    full = _llama(n_heads=4, n_kv_heads=2, head_dim=4)
    small = calc.pruned_spec(full, n_heads=2, n_kv_heads=1, ffn=8, n_layers=1)
    assert (small.n_heads, small.n_kv_heads, small.ffn, small.n_layers) == (2, 1, 8, 1)
    assert small.n_params == 800 + 800 + 16 + 800
    assert small.hidden == full.hidden and small.head_dim == full.head_dim


def test_pruned_spec_every_term_shrinks() -> None:
    full = _llama(n_heads=4, n_kv_heads=2, head_dim=4)
    small = calc.pruned_spec(full, n_heads=2, n_kv_heads=1, ffn=8, n_layers=1)
    big = calc.estimate(full, _train(), device="cpu")
    less = calc.estimate(small, _train(), device="cpu")
    assert less.peak_bytes < big.peak_bytes
    assert less.breakdown["weights"] < big.breakdown["weights"]


def test_pruned_spec_mha_stays_mha() -> None:
    small = calc.pruned_spec(TINY, n_heads=1)
    assert small.n_kv_heads == 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n_heads": 3}, "n_heads=3 must be a multiple of n_kv_heads=2"),
        ({"n_heads": 5}, "n_heads"),
        ({"ffn": 0}, "ffn"),
        ({"n_layers": 3}, "n_layers"),
        ({"n_kv_heads": True}, "n_kv_heads"),
    ],
)
def test_pruned_spec_validation(kwargs: dict, field: str) -> None:
    full = _llama(n_heads=4, n_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match=field):
        calc.pruned_spec(full, **kwargs)


def test_pruned_spec_gpt2_heads_refused() -> None:
    gpt2 = calc.load_card("gpt2")
    with pytest.raises(ValueError, match="c_attn"):
        calc.pruned_spec(gpt2, n_heads=6)
    assert calc.pruned_spec(gpt2, ffn=1024).ffn == 1024


def test_structured_slicing_matches_pruned_spec() -> None:
    """Slicing a real model (verify.models.pruning.prune_structured) gives pruned_spec's tensors."""
    torch = pytest.importorskip("torch")
    from verify.models.pruning import prune_structured
    from verify.models.reference import ReferenceLM

    full = _llama(n_heads=4, n_kv_heads=2, head_dim=4)
    small = calc.pruned_spec(full, n_heads=2, n_kv_heads=1, ffn=8, n_layers=1)
    model = ReferenceLM(full)
    prune_structured(model, full, small)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [tuple(p.shape) for p in ReferenceLM(small).parameters()]
    assert sum(p.numel() for p in model.parameters()) == small.n_params
    ids = torch.zeros(1, 4, dtype=torch.long)
    model.set_rope(4)
    assert model(ids, ids).ndim == 0  # the sliced model runs


def test_semi_structured_tensor_needs_cuda() -> None:
    """Where the CPU backend stops (torch 2.13): ``to_sparse_semi_structured`` accepts CUDA
    tensors only, so verify measures the 2:4 *masked* training step and the compressed sizes
    (`test_semi_structured_measured_with_torch_cpu`), never a 2:4 matmul."""
    torch = pytest.importorskip("torch")
    from torch.sparse import to_sparse_semi_structured

    w = torch.ones(64, 64, dtype=torch.bfloat16)
    w.view(64, 16, 4)[:, :, 2:] = 0
    with pytest.raises(RuntimeError, match="Only CUDA"):
        to_sparse_semi_structured(w)


def _r(nbytes: int) -> int:
    return max(512, -(-nbytes // 512) * 512)


@settings(max_examples=12, deadline=None)
@given(
    kv=st.integers(2, 3),
    group=st.integers(2, 3),
    d=st.sampled_from([4, 8, 12]),
    f=st.integers(4, 40),
    layers=st.sampled_from([2, 6, 9]),
    precision=st.sampled_from(["fp32", "bf16"]),
)
def test_prune_terms_property(
    kv: int, group: int, d: int, f: int, layers: int, precision: str
) -> None:
    # For any llama shape: at the optimizer step, pruning every linear adds exactly one mask
    # and one product per pruned weight, each r(numel * itemsize) bytes.
    a = kv * group
    model = _llama(hidden=a * d, n_heads=a, n_kv_heads=kv, head_dim=d, ffn=f, n_layers=layers)
    item = 4 if precision == "fp32" else 2
    h = a * d
    shapes = [(a * d, h), (kv * d, h), (kv * d, h), (h, a * d), (f, h), (f, h), (h, f)]
    extra = 2 * layers * sum(_r(o * i * item) for o, i in shapes)
    base = calc.estimate(model, _train(precision=precision), device="cpu").phases
    pruned = calc.estimate(model, _train(precision=precision, pruning=Pruning()), device="cpu")
    assert pruned.phases["step2/optimizer"] - base["step2/optimizer"] == extra
    assert pruned.peak_bytes >= max(base.values())
