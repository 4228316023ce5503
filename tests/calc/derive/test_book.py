"""calc.derive.book.second_step_sizes: the second optimizer step's sizes from the first's, on
hand-made recordings (no torch)."""

from __future__ import annotations

import pytest

from calc.derive.book import Trace, second_step_sizes

_INFO = (
    ("weight", "w", "base"),  # 0: the weight, live from the start
    ("act", "mm", 0),  # 1: step 1's activation (8 bytes per token)
    ("grad", "grad:w", 0),  # 2: step 1's gradient
    ("act", "mm", 0),  # 3: step 2's activation
    ("grad", "grad:w", 0),  # 4: step 2's gradient
)
_STREAM = (
    (True, 1, "step1/forward", 0),
    (True, 2, "step1/backward", 0),
    (False, 1, "step1/backward", 0),
    (False, 2, "step1/optimizer", "head"),  # zero_grad, applied as step 2 starts
    (True, 3, "step2/forward", 0),
    (True, 4, "step2/backward", 0),
    (False, 3, "step2/backward", 0),
    (False, 4, "step2/optimizer", "head"),
)


def _full(tokens: int, grad: int = 400) -> Trace:
    return Trace((100, 8 * tokens, 400, 8 * tokens, grad), _INFO, (0,), _STREAM)


def _one(tokens: int, stream: tuple = _STREAM[:3]) -> Trace:
    # The first step only: the same events, then what goes at its end (the gradient, and
    # the weight as the model goes).
    tail = ((False, 0, "step1/optimizer", "head"), (False, 2, "step1/optimizer", "head"))
    return Trace((100, 8 * tokens, 400), _INFO[:3], (0,), stream + tail)


def test_the_second_step_takes_the_first_steps_sizes() -> None:
    # At 128 tokens: the activation 8 * 128 = 1024 bytes in both steps, weight and gradient
    # unchanged.
    assert second_step_sizes(_full(64), _one(128)) == (100, 1024, 400, 1024, 400)


def test_a_first_step_recorded_otherwise_is_refused() -> None:
    # The activation freed before the gradient is made: another stream.
    swapped = (_STREAM[0], _STREAM[2], _STREAM[1])
    assert second_step_sizes(_full(64), _one(128, swapped)) is None


def test_a_second_step_unlike_the_first_is_refused() -> None:
    # Step 2's gradient of another size than step 1's: no counterpart to copy from.
    assert second_step_sizes(_full(64, grad=800), _one(128)) is None


def test_boolean_reads_answer_as_the_eager_run_of_the_batch() -> None:
    # unpadded prompts: "no padding?" and the other mask checks are true; a left-padded batch
    # (transformers 5.24, measured on llama): every mask check of generate and masking_utils
    # reads false
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from calc.derive.book import _scalar_read

    with FakeTensorMode():
        flag = torch.ones(2, 3, dtype=torch.long).sum() == 6
    assert _scalar_read(flag, "prefill") is True
    assert _scalar_read(flag, "prefill", padded=True) is False


def test_integer_reads_take_the_answers_given_in_order_then_are_refused() -> None:
    # generate's crop after a beam search reads the output length, then the generated length
    # (calc.derive.generate.stop_after hands them in); no answer left: refused by name
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from calc.derive.book import DeriveError, _scalar_read

    with FakeTensorMode():
        n = torch.ones(2, 3, dtype=torch.long).sum()
    answers = [14, 6]
    assert [_scalar_read(n, "decode", answers=answers) for _ in range(2)] == [14, 6]
    with pytest.raises(DeriveError, match=r"reads a value of a torch\.int64 tensor"):
        _scalar_read(n, "decode", answers=answers)
