"""verify's copy of torchtitan's Llama 3 against torchtitan 0.2.2 itself (skipped where
torchtitan does not import: its package imports a data and logging stack the project does not
need). Same weights: same parameters in the same order, same logits and gradients, and the
same bytes on the CPU tracker through the trainer's loss step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
tt_model = pytest.importorskip("torchtitan.models.llama3.model.model")
tt_args = pytest.importorskip("torchtitan.models.llama3.model.args")

from calc.config.jobs import Training  # noqa: E402
from verify.cases.scale import scaled_spec  # noqa: E402
from verify.measure.tracker import StorageTracker  # noqa: E402
from verify.models import torchtitan_llama  # noqa: E402

SEQ = 32


def _pair(kv_heads: int, layers: int = 2):
    spec = scaled_spec("llama-3.1-8b", kv_heads=kv_heads, layers=layers)
    job = Training(micro_batch=2, seq_len=SEQ, precision="fp32", implementation="torchtitan",
                   loop="del-logits")  # fmt: skip
    torch.manual_seed(0)
    ours = torchtitan_llama.build(spec, job, torch.float32)
    args = tt_args.TransformerModelArgs(
        dim=spec.hidden, n_layers=spec.n_layers, n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads, vocab_size=spec.vocab, norm_eps=spec.norm_eps,
        rope_theta=spec.rope_theta, max_seq_len=SEQ, attn_type="sdpa", multiple_of=spec.ffn,
        rope_scaling_args=tt_args.RoPEScalingArgs(scaling_factor=1.0, low_freq_factor=1.0,
                                                  high_freq_factor=1.0,
                                                  original_max_position_embeddings=SEQ),
    )  # fmt: skip
    theirs = tt_model.Transformer(args)
    assert theirs.layers["0"].feed_forward.w1.out_features == spec.ffn
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        q.data.copy_(p.data)
    return spec, ours, theirs


def _step_bytes(model, ids) -> tuple[int, int]:
    """(bytes live once the loss is made, the peak through backward) on the CPU tracker."""
    tracker = StorageTracker(scan_baseline=False, count_late=False)
    with tracker as tr:
        tr.track(ids)
        tr.classify(model=model, inputs=[ids])
        tr.reset_peak()
        loss = torchtitan_llama.TrainerLoss(model)(ids, ids)
        after_forward = tr.live_bytes
        loss.backward()
        del loss
    return after_forward, tr.peak_bytes


def _step_peak(model, ids) -> int:
    return _step_bytes(model, ids)[1]


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_copy_matches_torchtitan(kv_heads: int) -> None:
    # torchtitan keeps an fp32 model (its bf16 compute is FSDP2's policy, which casts both
    # alike): fp32 here; 1, 2 and 4 (all the query heads) key/value heads
    spec, ours, theirs = _pair(kv_heads)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    torch.testing.assert_close(ours.freqs_cis, theirs.freqs_cis, rtol=0, atol=0)
    ids = torch.randint(0, spec.vocab, (2, SEQ))
    out_ours, out_theirs = ours(ids), theirs(ids)
    assert out_ours.dtype == out_theirs.dtype == torch.float32
    torch.testing.assert_close(out_ours, out_theirs, rtol=0, atol=0)
    peaks = [_step_peak(m, ids) for m in (ours, theirs)]
    assert peaks[0] == peaks[1]
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("mode", ["full", "every2", "op"])
def test_checkpointing_matches_torchtitans_apply_ac(mode: str) -> None:
    # torchtitan's own apply_ac on its model (mode="full"; mode="selective" with
    # selective_ac_option="2", or "op" and llama3's save list) against the copy's
    # checkpointing: the same gradients, the same bytes once the loss is made and the same
    # peak. The copy's list adds CPU SDPA's flash kernel (standing for CUDA's): torchtitan's is
    # given the same. Its layer counter is global: reset, as in a fresh process.
    ac = pytest.importorskip("torchtitan.distributed.activation_checkpoint")
    config = pytest.importorskip("torchtitan.config.job_config")
    llama3 = pytest.importorskip("torchtitan.models.llama3.infra.parallelize")
    # MHA: CPU SDPA's flash kernel (math with GQA); three blocks: every 2nd is block 1 alone
    spec, _, theirs = _pair(kv_heads=4, layers=3)
    every = 2 if mode == "every2" else 1
    job = Training(micro_batch=2, seq_len=SEQ, precision="fp32", implementation="torchtitan",
                   loop="del-logits", recompute="full" if every == 2 else mode,
                   recompute_every=every)  # fmt: skip
    torch.manual_seed(0)
    ours = torchtitan_llama.build(spec, job, torch.float32)
    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    if mode == "full":
        ac_config = config.ActivationCheckpoint(mode="full")
    else:
        option = "2" if mode == "every2" else "op"
        ac_config = config.ActivationCheckpoint(mode="selective", selective_ac_option=option)
    ac._layer_sac_count = 0
    ac.apply_ac(theirs, ac_config, op_sac_save_list=llama3._op_sac_save_list | {cpu_flash})
    ids = torch.randint(0, spec.vocab, (2, SEQ))
    kept = [_step_bytes(m, ids) for m in (ours, theirs)]  # what the forward keeps, the peak
    assert kept[0] == kept[1]
    grads = [[p.grad for p in m.parameters()] for m in (ours, theirs)]
    for g, h in zip(*grads, strict=True):
        torch.testing.assert_close(g, h, rtol=0, atol=0)
