"""verify's copy of bitsandbytes' ``StableEmbedding`` (which LitGPT's QLoRA puts in place of
``wte``, ``verify.models.litgpt_lora.StableEmbedding``) against bitsandbytes itself (skipped
where it does not import): the same parameters in the same order and dtypes after
``.to(dtype)``, and, under the default dtype Fabric's ``forward_context`` sets, the same
output, the same tracker bytes over two iterations and the same gradients to the bit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
bnb_nn = pytest.importorskip("bitsandbytes.nn")

from tests.verify.models.iterations import assert_same_bytes_and_gradients  # noqa: E402
from verify.models import litgpt_lora  # noqa: E402


def _pair(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ours = litgpt_lora.StableEmbedding(96, 32).to(dtype=dtype)
    theirs = bnb_nn.StableEmbedding(96, 32).to(dtype=dtype)
    with torch.no_grad():
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            p.copy_(torch.randn_like(p))
            q.copy_(p)
    return ours, theirs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_copy_matches_bitsandbytes(dtype: torch.dtype) -> None:
    ours, theirs = _pair(dtype)
    assert [(n, p.shape, p.dtype) for n, p in ours.named_parameters()] == [
        (n, p.shape, p.dtype) for n, p in theirs.named_parameters()
    ]
    ids = torch.randint(0, 96, (2, 40))
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # Lightning's _DtypeContextManager around the forward
    try:
        torch.testing.assert_close(ours(ids), theirs(ids), rtol=0, atol=0)

        def step(model: torch.nn.Module):
            return lambda x, _: model(x).float().square().sum()

        assert_same_bytes_and_gradients(step(ours), step(theirs), (ours, theirs), ids)
    finally:
        torch.set_default_dtype(before)
