"""The real optimizers of a `calc.Training` job, built exactly as `calc.step.optimizer` assumes.

`build` picks the implementation explicitly (``foreach=True``, ``fused=True`` or neither: a CPU
run would otherwise take the per-tensor loop, ``torch/optim/adam.py`` ``_default_to_fused_or_
foreach``), `step` runs one step (through ``GradScaler`` for ``amp-fp16``), `zero_grad` sets the
gradients to None. Two optimizers are not in torch and are written here:

* `Lion` (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 1):
  ``update = sign(b1*m + (1-b1)*g)``, ``p -= lr*(update + wd*p)``, ``m = b2*m + (1-b2)*g``,
  written in `calc.derive.lion` (the recording of a derived model steps the same class);
* `BlockwiseAdam8bit`: used when ``bitsandbytes`` is not importable (the CPU case). It stores
  its state exactly as bitsandbytes' ``Optimizer2State`` does (uint8 ``state1``/``state2`` plus
  fp32 ``absmax1``/``absmax2`` per 256-element block; fp32 ``state1``/``state2`` below 4096
  elements, or everywhere for ``optim_bits=32``; with ``is_paged`` the large params' states
  out of the tracker's sight, as bitsandbytes puts them in managed memory); its quantisation map only approximates bitsandbytes' dynamic map, and its update
  works in chunks of `CHUNK` elements with ordinary tensor temporaries where bitsandbytes' CUDA
  kernel has none: at most `EMULATION_SCRATCH_BYTES` above what ``calc.step.optimizer`` counts.

``bf16-master`` is `MasterWeights`: bf16 model params and grads, fp32 masters made on the first
step, and per step ``master.grad = p.grad.float()``, the inner fp32 step, ``p.copy_(master)``,
``master.grad = None``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from calc.config.jobs import Training
from calc.data.bitsandbytes import BNB_BLOCK, BNB_MIN_8BIT_SIZE, BNB_PAGED_MIN_NUMEL
from calc.derive.lion import lion_class
from verify.models.litgpt_lora import stepped

CHUNK = 16 * BNB_BLOCK
"""Elements `BlockwiseAdam8bit` updates at a time."""
EMULATION_SCRATCH_BYTES = 8 * CHUNK * 8
"""Bound on `BlockwiseAdam8bit`'s temporaries beyond bitsandbytes' in-place kernel: fewer than
8 chunk-sized tensors of at most 8 B/element (the int64 gather index) are alive at once
(measured on torch 2.13 CPU: at most 83,456 B of the 262,144 allowed)."""


Lion = lion_class()
"""`calc.derive.lion`'s Lion: the optimizer the recording of a derived model steps too."""


def _dynamic_map(signed: bool) -> torch.Tensor:
    """256 sorted fp32 code values in [-1, 1] (signed) or [0, 1]: log-spaced magnitudes.

    An approximation of bitsandbytes' ``create_dynamic_map`` (dynamic tree quantisation): the
    memory is the same (256 fp32), the values are not."""
    if signed:
        pos = torch.logspace(-7, 0, 127)
        vals = torch.cat([-pos, torch.zeros(2), pos])
    else:
        vals = torch.cat([torch.zeros(1), torch.logspace(-7, 0, 255)])
    return vals.sort().values


_HOST_QMAPS = {"dynamic": _dynamic_map(True), "udynamic": _dynamic_map(False)}


class BlockwiseAdam8bit(torch.optim.Optimizer):
    """Adam with blockwise 8-bit states laid out as bitsandbytes ``Adam8bit`` lays them out.

    Coupled (L2) weight decay, as bitsandbytes' Adam kernels. See the module docstring for what
    is approximated."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        optim_bits: int = 8,
        is_paged: bool = False,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        # shared host maps, as bitsandbytes' fill_qmap makes on the CPU: not device memory
        self.qmaps = dict(_HOST_QMAPS)
        self.optim_bits = optim_bits
        """8 (``Adam8bit``) or 32 (``Adam32bit``: fp32 states for every param)."""
        self.is_paged = is_paged
        """Paged: the states of params of `BNB_PAGED_MIN_NUMEL` elements or more are made
        outside the dispatcher's view, as bitsandbytes makes them with ``cudaMallocManaged``
        outside PyTorch's allocator (``get_state_buffer``)."""

    def _buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """bitsandbytes ``get_state_buffer``: ``zeros_like``, or for a paged optimizer and a
        large param a buffer the allocator (here: the tracker) never sees."""
        if not self.is_paged or p.numel() < BNB_PAGED_MIN_NUMEL:
            return torch.zeros_like(p, dtype=dtype)
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return torch.zeros_like(p, dtype=dtype)

    def _init_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        state["step"] = 0
        n = p.numel()
        if n < BNB_MIN_8BIT_SIZE or self.optim_bits == 32:
            state["state1"] = self._buffer(p, torch.float32)
            state["state2"] = self._buffer(p, torch.float32)
            return
        for name in ("dynamic", "udynamic"):  # .to(p.device): a copy only on another device
            self.qmaps[name] = self.qmaps[name].to(p.device)
        blocks = -(-n // BNB_BLOCK)
        state["state1"] = self._buffer(p, torch.uint8)
        state["state2"] = self._buffer(p, torch.uint8)
        state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)

    @staticmethod
    def _dequant(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
        vals = qmap[codes.long()]
        scale = absmax.repeat_interleave(BNB_BLOCK)[: vals.numel()]
        return vals.mul_(scale)

    @staticmethod
    def _quant(
        x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor
    ) -> None:
        blocks = absmax.numel()
        padded = F.pad(x, (0, blocks * BNB_BLOCK - x.numel())).view(blocks, BNB_BLOCK)
        am = padded.abs().amax(dim=1)
        absmax.copy_(am)
        normed = padded.div_(am.clamp_(min=1e-30).unsqueeze(1))
        mids = (qmap[1:] + qmap[:-1]) / 2
        idx = torch.bucketize(normed, mids)
        codes.copy_(idx.view(-1)[: x.numel()])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self._init_state(p)
                self._update(p, group)
        return None

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        state["step"] += 1
        t = state["step"]
        b1, b2 = group["betas"]
        wd, eps = group["weight_decay"], group["eps"]
        step_size = group["lr"] / (1 - b1**t)
        bc2_sqrt = math.sqrt(1 - b2**t)
        flat_p, flat_g = p.view(-1), p.grad.view(-1)
        s1, s2 = state["state1"].view(-1), state["state2"].view(-1)
        eight_bit = s1.dtype == torch.uint8
        for lo in range(0, p.numel(), CHUNK):
            hi = min(lo + CHUNK, p.numel())
            pc = flat_p[lo:hi]
            g = flat_g[lo:hi].float()
            if wd != 0:
                g = g.add(pc.float(), alpha=wd)
            if eight_bit:
                blo, bhi = lo // BNB_BLOCK, -(-hi // BNB_BLOCK)
                a1, a2 = state["absmax1"][blo:bhi], state["absmax2"][blo:bhi]
                m = self._dequant(s1[lo:hi], a1, self.qmaps["dynamic"])
                v = self._dequant(s2[lo:hi], a2, self.qmaps["udynamic"])
            else:
                m, v = s1[lo:hi], s2[lo:hi]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = v.sqrt().div_(bc2_sqrt).add_(eps)
            pc.addcdiv_(m, denom, value=-step_size)
            del denom, g
            if eight_bit:
                self._quant(m, s1[lo:hi], a1, self.qmaps["dynamic"])
                self._quant(v, s2[lo:hi], a2, self.qmaps["udynamic"])


def bnb_adam(
    params: list[torch.Tensor], bits: int, paged: bool, **kw: Any
) -> torch.optim.Optimizer:
    """bitsandbytes' ``Adam{8,32}bit`` (``Paged...`` when ``paged``) when importable, else
    `BlockwiseAdam8bit` with those bits and paging."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return BlockwiseAdam8bit(params, optim_bits=bits, is_paged=paged, **kw)
    cls = getattr(bnb.optim, f"{'Paged' if paged else ''}Adam{bits}bit")
    return cls(params, **kw)


def adam8bit_class() -> type[torch.optim.Optimizer]:
    """``bitsandbytes.optim.Adam8bit`` when importable, else `BlockwiseAdam8bit`."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return BlockwiseAdam8bit
    return bnb.optim.Adam8bit


class MasterWeights:
    """bf16-master: an fp32 optimizer over fp32 copies of bf16 params.

    First step: ``masters = [p.detach().float()]`` and the inner optimizer over them. Each step:
    ``master.grad = p.grad.float()`` for all params, ``inner.step()``, ``p.copy_(master)``,
    ``master.grad = None``."""

    def __init__(
        self,
        params: list[torch.Tensor],
        make_inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    ) -> None:
        self.params = params
        self.make_inner = make_inner
        self.masters: list[torch.Tensor] | None = None
        self.inner: torch.optim.Optimizer | None = None

    @torch.no_grad()
    def step(self) -> None:
        if self.masters is None:
            self.masters = [p.detach().float() for p in self.params]
            self.inner = self.make_inner(self.masters)
        assert self.inner is not None
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)
            m.grad = None


@dataclass(eq=False)
class OptimizerBundle:
    """What one job's optimizer step needs: the stepper, the model params, the scaler."""

    job: Training
    params: list[torch.nn.Parameter]
    stepper: torch.optim.Optimizer | MasterWeights
    scaler: torch.amp.GradScaler | None = None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer holding the states (None for bf16-master before its first step)."""
        return self.stepper.inner if isinstance(self.stepper, MasterWeights) else self.stepper

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the bundle holds: params, grads, masters, states, scaler scalars."""
        out: list[torch.Tensor] = list(self.params)
        out += [p.grad for p in self.params if p.grad is not None]
        if isinstance(self.stepper, MasterWeights) and self.stepper.masters is not None:
            out += self.stepper.masters
        opt = self.optimizer
        if opt is not None:
            for st in opt.state.values():
                out += [v for v in st.values() if isinstance(v, torch.Tensor)]
            if isinstance(opt, BlockwiseAdam8bit):
                out += list(opt.qmaps.values())
        if self.scaler is not None:
            out += [t for t in (self.scaler._scale, self.scaler._growth_tracker) if t is not None]
        return out


def _make_factory(job: Training) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    impl, wd, name = job.optimizer_impl, job.weight_decay, job.optimizer
    flags = dict(foreach=impl == "foreach", fused=impl == "fused")
    if name in ("sgd", "sgd-momentum"):
        momentum = 0.9 if name == "sgd-momentum" else 0.0
        return lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=momentum, weight_decay=wd, **flags)
    if name in ("adam", "adamw"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return lambda ps: cls(ps, lr=1e-3, weight_decay=wd, **flags)
    if impl == "fused":
        raise ValueError(f"optimizer_impl='fused' is not available for optimizer={name!r}")
    if name == "adafactor":
        return lambda ps: torch.optim.Adafactor(
            ps, lr=1e-2, weight_decay=wd, foreach=impl == "foreach"
        )
    if name == "lion":
        return lambda ps: Lion(ps, lr=1e-4, weight_decay=wd, foreach=impl == "foreach")
    if job.optimizer == "adam32bit" or job.paged_optimizer:
        bits = 32 if job.optimizer == "adam32bit" else 8
        return lambda ps: bnb_adam(ps, bits, job.paged_optimizer, lr=1e-3, weight_decay=wd)
    cls8 = adam8bit_class()  # one implementation: optimizer_impl does not apply
    return lambda ps: cls8(ps, lr=1e-3, weight_decay=wd)


def optimizer_over(params: list[torch.Tensor], job: Training) -> torch.optim.Optimizer:
    """The job's optimizer over ``params`` (one per parameter under ``optimizer_in_backward``,
    as torchtune instantiates its optimizer config per parameter)."""
    return _make_factory(job)(params)


def build(model: torch.nn.Module, job: Training) -> OptimizerBundle:
    """The optimizer (and GradScaler, master wrapper) of ``job`` over ``model.parameters()``.

    The model must already be in the job's dtype: bf16 params for ``bf16``/``bf16-master``,
    fp32 otherwise (autocast keeps fp32 weights)."""
    params = stepped(model)  # LoRA: adapters only
    want = torch.bfloat16 if job.precision in ("bf16", "bf16-master") else torch.float32
    lora = getattr(job, "lora", None)
    if lora is not None and lora.adapter_dtype is not None:  # adapters in their own dtype
        want = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
            lora.adapter_dtype
        ]
    bad = sorted({str(p.dtype) for p in params if p.dtype != want})
    if bad:
        raise ValueError(f"precision={job.precision!r} needs {want} params, found {bad}")
    factory = _make_factory(job)
    stepper: torch.optim.Optimizer | MasterWeights
    stepper = MasterWeights(params, factory) if job.precision == "bf16-master" else factory(params)
    scaler = None
    if job.precision == "amp-fp16":
        scaler = torch.amp.GradScaler(params[0].device.type)
    return OptimizerBundle(job=job, params=params, stepper=stepper, scaler=scaler)


def scale_loss(bundle: OptimizerBundle, loss: torch.Tensor) -> torch.Tensor:
    """``scaler.scale(loss)`` for amp-fp16 (its first call makes the scale tensors), else loss."""
    return loss if bundle.scaler is None else bundle.scaler.scale(loss)


def step(bundle: OptimizerBundle) -> None:
    """One optimizer step; ``scaler.step`` + ``scaler.update`` under amp-fp16."""
    if bundle.scaler is None:
        bundle.stepper.step()
        return
    assert isinstance(bundle.stepper, torch.optim.Optimizer)
    bundle.scaler.step(bundle.stepper)
    bundle.scaler.update()


def zero_grad(bundle: OptimizerBundle) -> None:
    """``zero_grad(set_to_none=True)`` on the model params."""
    for p in bundle.params:
        p.grad = None
