"""Attention kernels and their mask (torch 2.13). The unfused attention cores, written out of
these ops, are model graph pieces: `calc.models.attention_core`."""

from __future__ import annotations

from dataclasses import dataclass

from calc.replay.tape import Node, Size, Tape, Tensor

MASK_ITEMSIZE = 1  # torch.bool
SCALAR_ITEMSIZE = 4  # the 0-d ``scalar_tensor`` of the mask's fill values (one 512-byte block)


@dataclass(frozen=True, slots=True)
class CudaFlash:
    """What the CUDA flash kernel allocates beyond the CPU one (torch 2.13, FlashAttention-2 in
    ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``, ``mha_fwd``/``mha_bwd``).

    Forward: after ``out`` and ``softmax_lse`` it always makes ``rng_state`` (``uint64[2]``)
    and ``_unused`` (``uint64[]``) on the device, and with dropout a second ``rng_state`` that
    replaces the first ("[Note] BC breaking change to flash seed/offset"; the meta kernel
    ``meta__scaled_dot_product_flash_attention`` in the 2.13 wheel's ``_meta_registrations.py``
    returns the same shapes). Both are outputs that autograd saves (``philox_seed``,
    ``philox_offset`` of ``_scaled_dot_product_flash_attention_backward``): two 512-byte blocks
    per layer until the backward.

    Backward (``mha_bwd``): after ``dq, dk, dv = empty_like(...)``, ``softmax_d`` fp32
    ``[b, a, round128(s)]``, ``dq_accum`` fp32 ``[b, round128(s), a, d_rounded]`` (``loop`` is
    always true, non-deterministic path) and, when k has fewer heads than q, ``dk_expanded`` and
    ``dv_expanded`` ``[b, s, a, d]`` in q's dtype, summed into dk, dv; all die when ``mha_bwd``
    returns (``softmax_d`` is dropped by ``_flash_attention_backward``)."""

    dropout: bool
    """Attention dropout on: the second ``rng_state``."""
    backward_temps: tuple[tuple[Size, int], ...]
    """``(numel, itemsize)`` of the backward's temporaries, in allocation order."""


RNG_ITEMSIZE = 8  # uint64


def sdpa_flash(
    tape: Tape, q: Tensor, k: Tensor, v: Tensor, lse_numel: Size, name: str,
    cuda: CudaFlash | None = None, mask: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Flash-style SDPA: output like q, fp32 logsumexp (``lse_numel`` elements; 0: none);
    saves q, k, v, out, lse, and ``mask``, an additive ``attn_mask`` (``attn_mask`` and
    ``attn_bias`` are saved for the backward in derivatives.yaml). ``cuda``: the CUDA flash
    kernel's own tensors (`CudaFlash`). The outputs are one call of a fused ``sdpa`` kernel's
    (`Tape.op_outputs`).

    Backward allocates dq, dk, dv (``_scaled_dot_product_flash_attention_for_cpu_backward``,
    ``_flash_attention_backward``), then ``cuda.backward_temps``, freed before it returns.
    """

    def rule(tape: Tape, node: Node, grads: list) -> list:
        out_grads = [
            tape.new(q.numel, q.itemsize, "dq"),
            tape.new(k.numel, k.itemsize, "dk"),
            tape.new(v.numel, v.itemsize, "dv"),
        ]
        temps = (
            [tape.new(n, size, f"{name}.bwd_tmp") for n, size in cuda.backward_temps]
            if cuda
            else []
        )
        tape.drop(*temps)
        return out_grads

    def make() -> list[Tensor | None]:
        out = tape.new(q.numel, q.itemsize, name)
        lse = tape.new(lse_numel, 4, f"{name}.lse") if lse_numel != 0 else None
        rng: list[Tensor] = []
        if cuda is not None:
            first = tape.new(2, RNG_ITEMSIZE, f"{name}.rng_state")
            rng = [first, tape.new(1, RNG_ITEMSIZE, f"{name}.rng_unused")]
            if cuda.dropout:  # rng_state = at::empty({2}, ...) again: the first one is released
                rng[0] = tape.new(2, RNG_ITEMSIZE, f"{name}.rng_state")
                tape.drop(first)
        return [out, lse, *rng]

    out, lse, *rng = tape.op_outputs("sdpa", make)
    assert out is not None
    saved = [q, k, v, out, lse, *rng] if mask is None else [q, k, v, mask, out, lse, *rng]
    n = tape.node("SDPA", rule, [q, k, v], saved=saved)
    tape.drop(lse, *rng)
    return tape.output(out, n)


def causal_bias(tape: Tape, s: Size, itemsize: int, name: str) -> Tensor:
    """``convert_boolean_attn_mask(ones(s, s, bool).tril(), dtype)``: ``where(mask, 0.0,
    scalar_tensor(-inf))`` with both fill values as 0-d tensors; no autograd."""
    ones = tape.new(s * s, MASK_ITEMSIZE, f"{name}.ones")
    tril = tape.new(s * s, MASK_ITEMSIZE, f"{name}.tril")
    tape.drop(ones)
    neg_inf = tape.new(1, SCALAR_ITEMSIZE, f"{name}.neg_inf")
    zero = tape.new(1, SCALAR_ITEMSIZE, f"{name}.zero")
    bias = tape.new(s * s, itemsize, name)
    tape.drop(zero, neg_inf, tril)
    return bias
