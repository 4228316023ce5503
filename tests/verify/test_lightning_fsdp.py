"""verify's engine for LitGPT on several devices (``verify/dist/engines.py`` ``_litgpt_fsdp``;
here, not under tests/verify/dist/, which pytest's default ``norecursedirs`` skips)
against Lightning's own ``FSDPStrategy`` as ``finetune/full.py`` builds it (skipped where
Lightning does not import; run here with lightning 2.5 installed by hand): the keyword arguments
it hands FSDP1, its precision's ``MixedPrecision`` and its checkpointing policy are the ones the
engine passes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
fsdp_strategy = pytest.importorskip("lightning.fabric.strategies.fsdp")
fsdp_precision = pytest.importorskip("lightning.fabric.plugins.precision.fsdp")

from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # noqa: E402

from verify.models import litgpt_llama  # noqa: E402


def _strategy():
    """``finetune/full.py``'s strategy with ``devices > 1`` (litgpt 0.5.12, lines 107-113)."""
    return fsdp_strategy.FSDPStrategy(
        auto_wrap_policy={litgpt_llama.Block},
        activation_checkpointing_policy={litgpt_llama.Block},
        state_dict_type="full",
        limit_all_gathers=True,
        cpu_offload=False,
    )


def test_the_strategy_wraps_each_block_with_its_original_parameters() -> None:
    kwargs = _strategy()._fsdp_kwargs
    assert kwargs["use_orig_params"] is True and kwargs["limit_all_gathers"] is True
    policy = kwargs["auto_wrap_policy"]
    assert isinstance(policy, ModuleWrapPolicy)
    assert policy._module_classes == {litgpt_llama.Block}


def test_the_strategy_checkpoints_each_block() -> None:
    policy = _strategy()._activation_checkpointing_kwargs["auto_wrap_policy"]
    assert isinstance(policy, ModuleWrapPolicy)
    assert policy._module_classes == {litgpt_llama.Block}


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16),
                                                   ("32-true", torch.float32)])  # fmt: skip
def test_the_true_precisions_keep_every_dtype_the_models(precision: str, dtype) -> None:
    mp = fsdp_precision.FSDPPrecision(precision).mixed_precision_config
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (dtype, dtype, dtype)
