"""Attention kernels and their mask (torch 2.13). The unfused attention cores, written out of
these ops, are model graph pieces: `calc.models.attention_core`."""

from __future__ import annotations

from calc.replay.tape import Node, Size, Tape, Tensor

MASK_ITEMSIZE = 1  # torch.bool
SCALAR_ITEMSIZE = 4  # the 0-d ``scalar_tensor`` of the mask's fill values (one 512-byte block)


def sdpa_flash(tape: Tape, q: Tensor, k: Tensor, v: Tensor, lse_numel: Size, name: str) -> Tensor:
    """Flash-style SDPA: output like q, fp32 logsumexp [b, a, s]; saves q, k, v, out, lse.

    Backward allocates dq, dk, dv (``_scaled_dot_product_flash_attention_for_cpu_backward``,
    ``_flash_attention_backward``); kernel-internal buffers are not tensors.
    """

    def rule(tape: Tape, node: Node, grads: list) -> list:
        return [
            tape.new(q.numel, q.itemsize, "dq"),
            tape.new(k.numel, k.itemsize, "dk"),
            tape.new(v.numel, v.itemsize, "dv"),
        ]

    out = tape.new(q.numel, q.itemsize, name)
    lse = tape.new(lse_numel, 4, f"{name}.lse")
    n = tape.node("SDPA", rule, [q, k, v], saved=[q, k, v, out, lse])
    tape.drop(lse)
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
