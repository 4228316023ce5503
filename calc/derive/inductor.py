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
    torch._dynamo.reset()
    try:
        for owner, name, value in swaps:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        torch._dynamo.reset()


def compile_model(model: Any, job: Any) -> None:
    """``model`` compiled as ``job.compile`` says (``"default"``: ``nn.Module.compile()``,
    the whole model, ``torch.compile``'s default mode; verify's ``compile_model``)."""
    if job.compile == "default":
        model.compile()
    else:  # the config refuses any other value first
        raise ValueError(f"compile={job.compile!r} is not recorded")
