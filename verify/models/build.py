"""Building what a case runs: the model (reference or hf) and the optimizer, from spec and job.

The optimizer goes through ``verify.models.optimizers`` (``build(model, job)``, ``step``,
``zero_grad``, ``scale_loss``) when it imports; otherwise a fallback here builds the
``torch.optim`` ones directly (no lion, adam8bit or bf16-master), with
the implementation (foreach / fused / for-loop) always passed explicitly: PyTorch's default is
foreach on CUDA but a per-tensor loop on CPU.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from calc.models import litgpt_arch
from verify.models import (
    compress,
    distill,
    litgpt_llama,
    litgpt_lora,
    loops,
    pruning,
    sac,
    torchtitan_llama,
    torchtune_llama,
)
from verify.models import hf as hf_model
from verify.models import offload as offloading
from verify.models.reference import ReferenceLM

if TYPE_CHECKING:
    from collections.abc import Callable

    from calc.config.jobs import Inference, Training
    from calc.config.model_spec import ModelSpec

LEARNING_RATE = 1e-3
"""Learning rate of every case (memory does not depend on it)."""
SGD_MOMENTUM = 0.9
"""Momentum of ``sgd-momentum`` (plain ``sgd`` has none, hence no state)."""

WEIGHT_DTYPE: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "amp-bf16": torch.float32,
    "amp-fp16": torch.float32,
    "bf16": torch.bfloat16,
    "bf16-master": torch.bfloat16,
    "fp16": torch.float16,
}
"""Dtype of the model's weights for each training or inference precision."""


class NotRunnable(Exception):
    """The harness cannot run this case yet (a helper module it needs is not there)."""


def _optional(module: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


# Imported here, before any tracker is entered: verify.models.optimizers makes module-level tensors
# (the 8-bit quantisation maps) that would otherwise count in the first case that imports it.
OPTIMIZERS = _optional("verify.models.optimizers")


# ---------------------------------------------------------------------- model


def build_model(
    spec: ModelSpec, job: Training | Inference, *, seed: int, device: str = "cpu"
) -> tuple[torch.nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The model ``job.implementation`` names, with weights in the job's dtype, and its loss
    ``(ids, targets) -> loss`` (hf: ``labels=ids``, shifted inside transformers)."""
    torch.manual_seed(seed)
    if job.implementation == "torchtune":  # a copy of torchtune's Llama and its recipe's loss
        with torch.device(device):
            tt = torchtune_llama.build(spec, job, WEIGHT_DTYPE[job.precision])
        lora = getattr(job, "lora", None)
        if lora is not None:  # the recipe's LoRA model: adapters in the model's dtype
            compress.apply(tt, job.quant, lora, WEIGHT_DTYPE[job.precision])
        return tt, torchtune_llama.RecipeLoss(tt, job)
    if job.implementation == "torchtitan":  # a copy of torchtitan's Llama 3 and its loss step
        with torch.device(device):
            titan = torchtitan_llama.build(spec, job, WEIGHT_DTYPE[job.precision])
        return titan, torchtitan_llama.TrainerLoss(titan)
    if job.implementation == "litgpt":  # a copy of LitGPT's Llama and its fine-tuning step
        spec = litgpt_arch.as_built(spec)  # the configuration litgpt builds
        if getattr(job, "lora", None) is not None:  # finetune/lora.py: its adapters and loop
            with torch.device(device):
                lit = litgpt_lora.build(spec, job, WEIGHT_DTYPE[job.precision])
            return lit, litgpt_lora.LoRAFineTuneLoss(lit, job.grad_accum)
        with torch.device(device):
            lit = litgpt_llama.build(spec, job, WEIGHT_DTYPE[job.precision])
        return lit, litgpt_llama.FineTuneLoss(lit, job.grad_accum)
    attention = "eager" if job.attention == "eager" else "sdpa"
    if job.implementation in ("hf", "derived"):  # derived: the hf model, calc derives
        if not hf_model.available():
            raise NotRunnable("transformers is not installed (the hf extra)")
        model = hf_model.build_hf(spec, attention, device=device)
        _checkpointing(model, job)

        def loss_fn(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return hf_model.hf_loss(model, ids, targets)

    else:
        recompute = getattr(job, "recompute", "none")
        with torch.device(device):
            model = ReferenceLM(spec, attention=attention, recompute=recompute)
        loss_fn = model
    dtype = WEIGHT_DTYPE[job.precision]
    if dtype != torch.float32:
        model.to(dtype)
    return model, _adapted(model, loss_fn, spec, job, seed=seed, device=device)


def _checkpointing(model: torch.nn.Module, job: Training | Inference) -> None:
    """transformers' activation checkpointing as the job asks: non-reentrant in 5.24
    (``gradient_checkpointing_enable`` is deprecated); ``every_n_layers``: layers 0, n, 2n, ...
    checkpointed; ``offload``: their inputs on the host (`verify.models.offload.SaveOnHost`)."""
    recompute = getattr(job, "recompute", "none")
    if recompute == "selective":
        raise NotRunnable("transformers has no selective recomputation")
    if recompute == "op":
        sac.enable_on(model)
        return
    if recompute != "full":
        return
    every = getattr(job, "recompute_every", 1)
    enable = getattr(model, "activation_checkpointing_enable", None)
    if getattr(job, "offload_activations", False):
        if enable is None:
            raise NotRunnable("this transformers has no offload (5.24 has)")
        offloading.save_on_host_around(model)  # whoever calls the model (any loop)
        enable(every_n_layers=every, offload=True)
    elif enable is not None:
        enable(every_n_layers=every)
    elif every == 1:
        model.gradient_checkpointing_enable()
    else:
        raise NotRunnable("this transformers has no every_n_layers")


def _adapted(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    spec: ModelSpec,
    job: Training | Inference,
    *,
    seed: int,
    device: str,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Compression, pruning, distillation and the loop applied to the built ``model``; the
    loss function that results."""
    dtype = WEIGHT_DTYPE[job.precision]
    if getattr(job, "quant", None) is not None or getattr(job, "lora", None) is not None:
        compress.apply(model, job.quant, getattr(job, "lora", None), dtype)
    if getattr(job, "pruning", None) is not None:  # torch.nn.utils.prune, final dtype
        pruning.apply(model, job.pruning, spec)
    if getattr(job, "distill", None) is not None:  # a frozen teacher beside the student
        if job.implementation != "reference":
            raise NotRunnable("distillation runs with implementation='reference' only")
        loss_fn = distill.wrap(model, job, seed=seed, device=device)
    if hasattr(job, "loop") and not loops.is_default(job):  # another loop or loss
        loss_fn = loops.Loop(model, job)
    return loss_fn


def build_reference_on_meta(spec: ModelSpec) -> ReferenceLM:
    """The reference model on the ``meta`` device: shapes only (for full-size cards)."""
    with torch.device("meta"):
        return ReferenceLM(spec)


# ---------------------------------------------------------------------- optimizer


@dataclass(slots=True)
class OptBundle:
    """What the optimizer step needs: ``verify.models.optimizers``' bundle when that module built it,
    else a ``torch.optim`` optimizer and the GradScaler for ``amp-fp16``."""

    fallback: torch.optim.Optimizer | None = None
    scaler: Any | None = None
    model: torch.nn.Module | None = None
    """Without an optimizer (``optimizer=None``): the model whose gradients ``zero_grad`` drops."""
    external: Any | None = None
    """The bundle ``verify.models.optimizers.build`` returned."""
    module: Any | None = None
    """``verify.models.optimizers`` itself, when it built the bundle."""

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer holding the states (None for bf16-master before its first step)."""
        if self.external is not None:
            return self.external.optimizer
        return self.fallback

    @property
    def extra_states(self) -> list[torch.Tensor]:
        """Tensors the step holds besides the optimizer's states: fp32 masters (bf16-master)."""
        masters = getattr(getattr(self.external, "stepper", None), "masters", None)
        return list(masters or [])

    def step(self) -> None:
        """One optimizer step (through the scaler for ``amp-fp16``)."""
        if self.module is not None:
            self.module.step(self.external)
        elif self.model is not None:
            return  # forward and backward alone
        elif self.scaler is not None:
            self.scaler.step(self.fallback)
            self.scaler.update()
        else:
            self.fallback.step()

    def zero_grad(self) -> None:
        """``zero_grad(set_to_none=True)``."""
        if self.module is not None:
            self.module.zero_grad(self.external)
        elif self.model is not None:
            self.model.zero_grad(set_to_none=True)
        else:
            self.fallback.zero_grad(set_to_none=True)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``scaler.scale(loss)`` under ``amp-fp16``, else ``loss``."""
        if self.module is not None:
            return self.module.scale_loss(self.external, loss)
        return loss if self.scaler is None else self.scaler.scale(loss)


def impl_kwargs(impl: str) -> dict[str, bool]:
    """The ``torch.optim`` keyword that pins the implementation."""
    return {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}[
        impl
    ]


def _torch_optimizer(params: list[torch.Tensor], job: Training) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer of ``job`` over ``params``, implementation pinned."""
    wd, kw, name = job.weight_decay, impl_kwargs(job.optimizer_impl), job.optimizer
    if name in ("sgd", "sgd-momentum"):
        momentum = SGD_MOMENTUM if name == "sgd-momentum" else 0.0
        return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=momentum, weight_decay=wd, **kw)
    classes = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
               "adafactor": torch.optim.Adafactor}  # fmt: skip
    if name not in classes:
        raise NotRunnable(f"optimizer={name!r} needs verify.models.optimizers")
    return classes[name](params, lr=LEARNING_RATE, weight_decay=wd, **kw)


def _optimizer_in_backward(model: torch.nn.Module, job: Training) -> None:
    """One optimizer per trainable parameter, stepped then zeroed by a post-accumulate-grad
    hook (torchtune/training/memory.py ``register_optim_in_bwd_hooks``)."""
    bnb = job.optimizer in ("adam8bit", "adam32bit")  # torchtune's bitsandbytes configs
    if bnb and OPTIMIZERS is None:
        raise NotRunnable(f"optimizer={job.optimizer!r} needs verify.models.optimizers")
    make = OPTIMIZERS.optimizer_over if bnb else _torch_optimizer
    optims = {p: make([p], job) for p in model.parameters() if p.requires_grad}

    def step(param: torch.Tensor) -> None:
        optims[param].step()
        optims[param].zero_grad(set_to_none=True)

    for p in optims:
        p.register_post_accumulate_grad_hook(step)
    model._optimizers_in_backward = optims  # type: ignore[assignment]  # kept alive with it


def build_optimizer(model: torch.nn.Module, job: Training, device: str = "cpu") -> OptBundle:
    """The job's optimizer over ``model.parameters()``, implementation pinned."""
    if job.optimizer is None:  # forward and backward alone: no optimizer, no scaler
        return OptBundle(model=model)
    if job.optimizer_in_backward:  # torchtune's optimizer_in_bwd: steps run in the backward
        _optimizer_in_backward(model, job)
        return OptBundle(model=model)
    ext = OPTIMIZERS
    if ext is not None and all(hasattr(ext, f) for f in ("build", "step", "zero_grad")):
        external = ext.build(model, job)
        return OptBundle(scaler=external.scaler, external=external, module=ext)
    scaler = torch.amp.GradScaler(device) if job.precision == "amp-fp16" else None
    if job.precision == "bf16-master":
        raise NotRunnable("bf16-master needs verify.models.optimizers (fp32 master weights)")
    params = litgpt_lora.stepped(model)
    return OptBundle(fallback=_torch_optimizer(params, job), scaler=scaler)
