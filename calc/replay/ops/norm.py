"""Fused normalisation kernels (torch 2.13). RMSNorm is written out of elementwise ops by the
graphs that use it (`calc.models.reference`, `calc.models.hf`)."""

from __future__ import annotations

from calc.replay.tape import Node, Size, Tape, Tensor


def layer_norm(
    tape: Tape, x: Tensor, w: Tensor, bias: Tensor | None, rows: Size, stats_itemsize: int = 4
) -> Tensor:
    """``native_layer_norm``: output, mean and rstd [rows] (fp32 by default; the CPU kernel
    keeps them in the input's dtype when the weight has it too, ``param_scalar_type`` in
    aten/src/ATen/native/layer_norm.cpp: ``stats_itemsize``); saves input, mean, rstd (and
    the affine weight/bias). Backward ``native_layer_norm_backward``: dx, dw, db."""

    def rule(tape: Tape, node: Node, grads: list) -> list:
        gx = tape.new(x.numel, x.itemsize, "dln.in") if tape.needs_grad(x) else None
        gw = tape.new(w.numel, w.itemsize, "dln.w")
        gb = tape.new(bias.numel, bias.itemsize, "dln.b") if bias is not None else None
        return [gx, gw, gb]

    out = tape.new(x.numel, x.itemsize, "ln.out")
    mean = tape.new(rows, stats_itemsize, "ln.mean")
    rstd = tape.new(rows, stats_itemsize, "ln.rstd")
    n = tape.node("LayerNorm", rule, [x, w, bias], saved=[x, mean, rstd])
    tape.drop(mean, rstd)
    return tape.output(out, n)
