"""Where a decoder layer of transformers keeps the linears LoRA adapts and quantization packs
(`calc.derive.lora`, `calc.derive.quantized`, verify's ``compress.apply``).

Each site is the LoRA module names the linear computes and its attribute path in the layer:
- the llama-family projections by name (``self_attn.q_proj`` ... ``mlp.down_proj``);
- Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` (one linear computes several names: an
  adapter takes all of them or none);
- latent attention (DeepSeek-V2/V3, transformers ``modeling_deepseek_v3.py``): ``q`` is
  ``q_proj`` or the low-rank pair ``q_a_proj``, ``q_b_proj``; ``k`` and ``v`` come from the
  same two latent projections ``kv_a_proj_with_mqa`` (the latent and the shared RoPE key)
  and ``kv_b_proj`` (the keys' no-RoPE part and the values);
- the shared experts of a mixture of experts (``mlp.shared_experts`` of DeepSeek,
  ``mlp.shared_expert`` of Qwen2-MoE), llama-style MLPs.

The routed experts of transformers 5's mixtures (``mlp.experts``: ``gate_up_proj`` and
``down_proj`` are 3-D parameters of every expert, not ``nn.Linear``) and the routers are no
site: peft's ``target_modules`` adapt ``nn.Linear`` modules, and bitsandbytes replaces those.
"""

from __future__ import annotations

LINEARS: dict[str, tuple[str, str]] = {
    "q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"), "v": ("self_attn", "v_proj"),
    "o": ("self_attn", "o_proj"), "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"),
    "down": ("mlp", "down_proj"),
}  # fmt: skip
"""LoRA module name -> (submodule, attribute) of a llama-family decoder layer."""
FUSED: dict[tuple[str, ...], tuple[str, str]] = {
    ("q", "k", "v"): ("self_attn", "qkv_proj"),
    ("gate", "up"): ("mlp", "gate_up_proj"),
}
"""LoRA module names -> the one fused linear that computes them all (Phi-3)."""

Site = tuple[tuple[str, ...], tuple[str, ...]]
"""(LoRA module names the linear computes, its attribute path in the decoder layer)."""

SITES: tuple[Site, ...] = (
    *(((name,), path) for name, path in LINEARS.items()),
    *((parts, path) for parts, path in FUSED.items()),
    (("q",), ("self_attn", "q_a_proj")),
    (("q",), ("self_attn", "q_b_proj")),
    (("k", "v"), ("self_attn", "kv_a_proj_with_mqa")),
    (("k", "v"), ("self_attn", "kv_b_proj")),
    *(((name,), ("mlp", shared, f"{name}_proj"))
      for shared in ("shared_experts", "shared_expert") for name in ("gate", "up", "down")),
)  # fmt: skip
"""Every site, in the order adapters and quantized linears are made (the llama-family ones
first, so a llama layer's order is its projections')."""


MLP_NAMES: tuple[str, ...] = ("gate", "up", "down")
"""The LoRA names of an MLP: in a mixture of experts, what its routed experts compute."""


def has_experts(layer: object) -> bool:
    """Whether a decoder ``layer`` routes its tokens to experts (transformers' ``mlp.experts``)."""
    return getattr(getattr(layer, "mlp", None), "experts", None) is not None


def parent_of(layer: object, path: tuple[str, ...]) -> object | None:
    """The module holding the last attribute of ``path`` in ``layer``, or ``None``."""
    node: object | None = layer
    for attr in path[:-1]:
        node = getattr(node, attr, None)
        if node is None:
            return None
    return node
