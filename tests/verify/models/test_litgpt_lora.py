"""verify's copy of LitGPT's LoRA fine-tuning against litgpt 0.5.12 itself (skipped where litgpt
or Lightning does not import), called as ``finetune/lora.py`` calls it: the model built in
Fabric's ``init_module``, ``mark_only_lora_as_trainable``, wrapped by ``fabric.setup_module``,
``max_seq_length`` set, the head in 128-token chunks. Same parameters in the same order, same
logits chunks, loss and adapter gradients, and the same bytes on the CPU tracker through two
iterations, for adapters on the fused qkv (all of q, k, v, or some: ``zero_pad``), grouped
and multi-head attention (grouped: one conv1d per part), the projection and the MLP."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
lit_lora = pytest.importorskip("litgpt.lora")
lit_utils = pytest.importorskip("litgpt.utils")
fabric_mod = pytest.importorskip("lightning.fabric")

from calc.config.compression import LoRA  # noqa: E402
from calc.config.jobs import Training  # noqa: E402
from calc.models import litgpt_arch  # noqa: E402
from tests.verify.models.iterations import (  # noqa: E402
    assert_same_bytes_and_gradients,
    two_iterations,
)
from tests.verify.models.test_litgpt_llama import (  # noqa: E402
    FALCON,
    GEMMA,
    NEOX,
    PHI,
    config_fields,
    family_spec,
)
from verify.cases.scale import scaled_spec  # noqa: E402
from verify.models import litgpt_lora  # noqa: E402


def _pair(kv_heads: int, lora: LoRA, seq: int, precision: str = "bf16", spec=None):
    spec = spec or scaled_spec("llama-3.1-8b", kv_heads=kv_heads, layers=2)
    job = Training(micro_batch=2, seq_len=seq, precision=precision, implementation="litgpt",
                   loop="hold-output", loss="chunked-ce", lora=lora)  # fmt: skip
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    ours = litgpt_lora.build(spec, job, dtype)
    on = litgpt_lora.flags(lora)
    config = lit_lora.Config(
        **config_fields(spec), lora_r=lora.rank,
        lora_alpha=lora.rank if lora.alpha is None else lora.alpha, lora_dropout=lora.dropout,
        lora_query=on["query"], lora_key=on["key"], lora_value=on["value"],
        lora_projection=on["projection"], lora_mlp=on["mlp"], lora_head=on["head"],
    )  # fmt: skip
    fabric = fabric_mod.Fabric(
        accelerator="cpu", devices=1, precision={"fp32": "32-true", "bf16": "bf16-true"}[precision]
    )
    with fabric.init_module(empty_init=False):
        theirs = lit_lora.GPT(config)
    lit_lora.mark_only_lora_as_trainable(theirs)
    theirs = fabric.setup_module(theirs)
    theirs.max_seq_length = seq
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        q.data.copy_(p.data)
        q.data.add_(0.01)  # B is zero at init: nonzero adapters make the gradients differ
        p.data.copy_(q.data)
    return spec, ours, theirs


def _their_step(model, accumulation: int):
    state: dict = {}

    def step(ids, targets):
        state["logits"] = model(ids, lm_head_chunk_size=128)
        state["logits"][-1] = state["logits"][-1][..., :-1, :]
        state["loss"] = lit_utils.chunked_cross_entropy(state["logits"], targets[..., 1:])
        return state["loss"] / accumulation

    return step


CASES = [
    # (kv heads, modules, tokens): grouped and multi-head; q and v (litgpt's defaults, so
    # zero_pad), all three (no padding), q alone with the projection and the MLP; 1 or 2
    # head chunks (the last one short or whole)
    (1, ("q", "v"), 200),
    (4, ("q", "v"), 200),
    (4, ("q", "k", "v"), 64),
    (1, ("q", "k", "v", "o", "gate", "up", "down"), 256),
    (4, ("q", "o", "gate", "up", "down"), 250),
    # lora_head: LoRALinear on the head's 128-token slices, whose fold of the undropped slice
    # copies it (two sequences); two chunks, and one (the whole sequence: a view)
    (1, ("q", "v", "lm_head"), 250),
    (4, ("k", "lm_head"), 100),
]


@pytest.mark.parametrize(("kv_heads", "modules", "seq"), CASES)
def test_copy_matches_litgpt(kv_heads: int, modules: tuple, seq: int) -> None:
    lora = LoRA(rank=4, alpha=8, modules=modules)
    spec, ours, theirs = _pair(kv_heads, lora, seq)
    names = [n for n, _ in theirs.module.named_parameters()]
    assert [n for n, _ in ours.named_parameters()] == names
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable == [n for n, p in theirs.module.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n in trainable) and trainable
    ids = torch.randint(0, spec.vocab, (2, seq))
    mine = litgpt_lora.LoRAFineTuneLoss(ours, accumulation=1)
    assert_same_bytes_and_gradients(mine, _their_step(theirs, 1), (ours, theirs), ids)
    assert [t.dtype for t in mine.logits or []] == [torch.float32] * len(mine.logits or [])


def test_dropout_and_fp32_match_litgpt() -> None:
    # lora_dropout (finetune/lora.py's default 0.05) on 32-true: the same bytes (the values
    # differ with the dropout masks' random draws, so only the memory is compared)
    lora = LoRA(rank=4, modules=("q", "v"), dropout=0.05)
    spec, ours, theirs = _pair(1, lora, 130, precision="fp32")
    ids = torch.randint(0, spec.vocab, (2, 130))
    mine = litgpt_lora.LoRAFineTuneLoss(ours, accumulation=1)
    peaks = [two_iterations(s, m, ids) for s, m in ((mine, ours), (_their_step(theirs, 1), theirs))]
    assert peaks[0] == peaks[1]


def test_dropout_on_the_head_adapter_matches_litgpt() -> None:
    # lora_head with lora_dropout: each slice's dropped copy folds as a view
    lora = LoRA(rank=4, modules=("v", "lm_head"), dropout=0.05)
    spec, ours, theirs = _pair(4, lora, 200)
    ids = torch.randint(0, spec.vocab, (2, 200))
    mine = litgpt_lora.LoRAFineTuneLoss(ours, accumulation=1)
    peaks = [two_iterations(s, m, ids) for s, m in ((mine, ours), (_their_step(theirs, 1), theirs))]
    assert peaks[0] == peaks[1]


@pytest.mark.parametrize(
    "config", [PHI, NEOX, FALCON, GEMMA], ids=["phi", "gpt_neox", "falcon", "gemma"]
)
def test_each_family_matches_litgpt(config: dict) -> None:
    # litgpt/lora.py on phi-2, GPT-NeoX, Falcon and Gemma: LoRALinear and LoRAQKVLinear keep
    # the base's biases (frozen), GptNeoxMLP's fc and proj adapted; every linear and the head
    # (phi-2's lora.yaml), two head chunks
    lora = LoRA(rank=4, alpha=8, modules=("q", "k", "v", "o", "gate", "up", "down", "lm_head"))
    spec, ours, theirs = _pair(4, lora, 200, spec=family_spec(config))
    names = [n for n, _ in theirs.module.named_parameters()]
    assert [n for n, _ in ours.named_parameters()] == names
    assert f"transformer.h.0.mlp.{'fc_1' if config is GEMMA else 'fc'}.lora_A" in names
    assert ("lm_head.linear.bias" in names) == (config is PHI)  # phi-2's head has a bias
    ids = torch.randint(0, spec.vocab, (2, 200))
    mine = litgpt_lora.LoRAFineTuneLoss(ours, accumulation=1)
    assert_same_bytes_and_gradients(mine, _their_step(theirs, 1), (ours, theirs), ids)


@pytest.mark.parametrize(
    ("card", "kept"),
    [
        # Qwen2.5 (attn_bias: the qkv's bias alone): LoRAQKVLinear keeps it
        ("qwen2.5-0.5b", "transformer.h.0.attn.qkv.linear.bias"),
        # Qwen3 (norm_qk): the base attention's frozen head norms
        ("qwen3-8b", "transformer.h.0.attn.norm_q.weight"),
    ],
    ids=["qwen2", "qwen3"],
)
def test_qwen_attentions_match_litgpt(card: str, kept: str) -> None:
    lora = LoRA(rank=4, alpha=8, modules=("q", "v", "o", "gate", "up", "down"))
    spec = litgpt_arch.as_built(scaled_spec(card, kv_heads=2, layers=2))
    spec, ours, theirs = _pair(2, lora, 150, spec=spec)
    names = [n for n, _ in theirs.module.named_parameters()]
    assert [n for n, _ in ours.named_parameters()] == names
    assert kept in names
    ids = torch.randint(0, spec.vocab, (2, 150))
    mine = litgpt_lora.LoRAFineTuneLoss(ours, accumulation=1)
    assert_same_bytes_and_gradients(mine, _their_step(theirs, 1), (ours, theirs), ids)
