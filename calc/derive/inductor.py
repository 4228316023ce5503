"""``torch.compile``'s generated code, run on fake tensors (``Training(compile="default")``).

A compiled training step allocates what Inductor's generated Python wrapper allocates
(``torch/_inductor/codegen/wrapper.py``): ``empty_strided_cpu`` buffers, views of them taken by
``reinterpret_tensor`` (its in-place reuse: ``buf5 = buf2; del buf2  # reuse``), the outputs of
extern kernels and fallback ops (``extern_kernels.mm(..., out=buf)``,
``aten._scaled_dot_product_flash_attention_for_cpu``), each freed by ``del`` when dead; the
forward hands AOTAutograd's saved set (``torch/_functorch/partitioners.py``,
``min_cut_rematerialization_partition``) to the backward. The real compiler decides all of it
here: Dynamo traces transformers' model, AOTAutograd partitions it, Inductor schedules, fuses
and plans the buffers, and the wrapper runs on the recording's fake tensors. Three things are
swapped, and only while `fake_inductor` is open:

* the C++ kernels are never built (``AsyncCompile.cpp_pybinding`` gives a callable that does
  nothing): they compute values in buffers the wrapper has allocated, and allocate nothing;
* ``empty_strided_cpu`` and ``reinterpret_tensor``, which the wrapper binds from
  ``torch._C._dynamo.guards`` and which make tensors without the dispatcher, become
  ``torch.empty_strided`` and ``torch.as_strided``: the same storage and view, seen by the
  recording's dispatch mode and made fake by the fake mode;
* Inductor's on-disk graph caches are off, and Dynamo's caches are cleared on entry and on
  exit, so no stubbed code outlives the recording and no real compiled code enters it.

The recording's dispatch mode says ``ignore_compile_internals``: torch then turns it off while
it compiles and on again while the compiled code runs (``torch/utils/_python_dispatch.py``).

torch is imported only inside these functions: ``calc`` imports without it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any


def _noop_kernel(*_args: Any, **_kwargs: Any) -> None:
    """A generated C++ kernel: it fills buffers the wrapper allocated; nothing to record."""


@contextlib.contextmanager
def fake_inductor() -> Iterator[None]:
    """Inductor's generated code runnable on fake tensors (module docstring), then restored."""
    import torch
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config

    guards = torch._C._dynamo.guards

    def build(_self: Any, _argtypes: Any, _source: Any, *_a: Any, **_k: Any) -> Any:
        return _noop_kernel

    def empty_strided(size: Any, stride: Any, dtype: Any) -> Any:
        return torch.empty_strided(size, stride, dtype=dtype, device="cpu")

    def reinterpret(t: Any, size: Any, stride: Any, offset: Any) -> Any:
        return torch.as_strided(t, size, stride, offset)

    swaps = [
        (async_compile.AsyncCompile, "cpp_pybinding", build),
        (guards, "_empty_strided_cpu", empty_strided),
        (guards, "_reinterpret_tensor", reinterpret),
        (inductor_config, "fx_graph_cache", False),
        (inductor_config, "fx_graph_remote_cache", False),
        (functorch_config, "enable_autograd_cache", False),
        # one shape per compile, as in a measured run: no dynamic-shape recompilation
        (torch._dynamo.config, "automatic_dynamic_shapes", False),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    log = logging.getLogger("torch._dynamo")  # its recompile-limit warning: a note says it
    level = log.level
    torch._dynamo.reset()
    try:
        for owner, name, value in swaps:
            setattr(owner, name, value)
        log.setLevel(logging.ERROR)
        yield
    finally:
        log.setLevel(level)
        for owner, name, value in saved:
            setattr(owner, name, value)
        torch._dynamo.reset()


def compile_model(model: Any, layers: Any, job: Any) -> None:
    """``model`` compiled as ``job.compile`` says, in ``torch.compile``'s default mode (verify's
    ``compile_model``): ``"default"``, the whole model (``nn.Module.compile()``);
    ``"regional"``, each decoder layer of ``layers`` on its own. A layer's ``forward`` is
    compiled rather than its ``__call__`` (``layer.compile()``): the same graph when the layer
    has no hooks, and the recording's layer hooks then run outside it, so the layers keep their
    tags. Every layer is recorded all the same: transformers' layers keep their index as an
    int (``self.layer_idx``), which Dynamo specialises on, so each layer is a graph of its own
    and, past ``torch._dynamo.config.recompile_limit`` (8) of them, the rest run eagerly
    (measured: a 14-layer Phi-3 compiles 8); the recording meets the same limit."""
    import torch

    if job.compile == "default":
        model.compile()
    elif job.compile == "regional":
        for layer in layers:
            layer.forward = torch.compile(layer.forward)
    else:  # the config refuses any other value first
        raise ValueError(f"compile={job.compile!r} is not recorded")


def compiles(job: Any) -> bool:
    """Whether ``job`` compiles the model (``compile`` of a training job not ``none``)."""
    return getattr(job, "compile", "none") != "none"


def whole_graph(job: Any) -> bool:
    """Whether ``job`` compiles the model as one graph (no layer can be told apart in it)."""
    return bool(getattr(job, "compile", "none") == "default")
