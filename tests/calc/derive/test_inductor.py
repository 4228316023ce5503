"""`calc.derive.inductor`: what it swaps while a compiled step is recorded, and that nothing of
it outlives the recording (a later real ``torch.compile`` must run real kernels)."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")

from calc.derive.inductor import fake_inductor  # noqa: E402


def _swapped() -> tuple[object, object, object]:
    import torch._inductor.async_compile as async_compile

    guards = torch._C._dynamo.guards
    return (
        async_compile.AsyncCompile.cpp_pybinding,
        guards._empty_strided_cpu,
        guards._reinterpret_tensor,
    )


def test_inside_the_buffers_reach_the_dispatcher_and_are_fake() -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with fake_inductor(), FakeTensorMode():
        buf = torch._C._dynamo.guards._empty_strided_cpu((4, 8), (8, 1), torch.float32)
        view = torch._C._dynamo.guards._reinterpret_tensor(buf, (8, 4), (4, 1), 0)
    assert isinstance(buf, FakeTensor) and isinstance(view, FakeTensor)
    assert view.untyped_storage()._cdata == buf.untyped_storage()._cdata  # a view, no storage


def test_everything_is_restored_on_exit_even_after_an_error() -> None:
    before = _swapped()
    with pytest.raises(RuntimeError), fake_inductor():
        assert _swapped() != before
        raise RuntimeError("the recording failed")
    assert _swapped() == before


@pytest.mark.slow
@pytest.mark.skipif(
    not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")),
    reason="Inductor's CPU backend needs a C++ compiler",
)
def test_a_real_compile_afterwards_computes_real_values() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sin() + 1

    x = torch.arange(6, dtype=torch.float32)
    with fake_inductor():
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            torch.compile(f)(torch.ones(6))  # compiled with the kernels stubbed
    assert torch.allclose(torch.compile(f)(x), f(x))
