"""verify's copy of torchtune's Llama against torchtune itself (skipped where torchtune does not
import: it installs from the package index with datasets, torchdata and torchao, which the
project does not need). Same weights: same parameters in the same order, same logits and
gradients, and the same bytes on the CPU tracker through a training step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
tt_llama3 = pytest.importorskip("torchtune.models.llama3._component_builders")

from calc.config.jobs import Training  # noqa: E402
from verify.cases.scale import scaled_spec  # noqa: E402
from verify.measure.tracker import StorageTracker  # noqa: E402
from verify.models import torchtune_llama  # noqa: E402


def _pair(kv_heads: int, dtype: torch.dtype):
    spec = scaled_spec("llama-3.1-8b", kv_heads=kv_heads, max_positions=128)
    job = Training(micro_batch=2, seq_len=32, precision="fp32", implementation="torchtune",
                   loop="del-logits")  # fmt: skip
    torch.manual_seed(0)
    ours = torchtune_llama.build(spec, job, torch.float32)
    theirs = tt_llama3.llama3(
        vocab_size=spec.vocab, num_layers=spec.n_layers, num_heads=spec.n_heads,
        num_kv_heads=spec.n_kv_heads, embed_dim=spec.hidden, max_seq_len=spec.max_positions,
        intermediate_dim=spec.ffn, norm_eps=spec.norm_eps, rope_base=spec.rope_theta,
    )  # fmt: skip
    theirs.load_state_dict(ours.state_dict())
    for m in (ours, theirs):
        if dtype != torch.float32:  # torchtune builds under set_default_dtype: fp32 RoPE
            m.to(dtype)
            rope = m.layers[0].attn.pos_embeddings
            del rope.theta, rope.cache
            rope.rope_init()
    return spec, ours, theirs


def _step_peak(model, ids, targets) -> int:
    tracker = StorageTracker(scan_baseline=False, count_late=False)
    with tracker as tr:
        tr.track(ids, targets)
        tr.classify(model=model, inputs=[ids, targets])
        tr.reset_peak()
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                 targets.reshape(-1))  # fmt: skip
        del logits
        loss.backward()
        del loss
    return tr.peak_bytes


@pytest.mark.parametrize(("kv_heads", "dtype"), [(1, torch.bfloat16), (2, torch.float32)])
def test_copy_matches_torchtune(kv_heads: int, dtype: torch.dtype) -> None:
    spec, ours, theirs = _pair(kv_heads, dtype)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    ids = torch.randint(0, spec.vocab, (2, 32))
    out_ours, out_theirs = ours(ids), theirs(ids)
    assert out_ours.dtype == out_theirs.dtype == torch.float32  # the logits upcast
    torch.testing.assert_close(out_ours, out_theirs, rtol=0, atol=0)
    peaks = [_step_peak(m, ids, ids) for m in (ours, theirs)]
    assert peaks[0] == peaks[1]
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
