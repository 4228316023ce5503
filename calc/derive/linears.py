"""Where a decoder layer of transformers keeps the linears LoRA adapts and quantization packs:
the llama-family projections by name, and Phi-3's fused ones (`calc.derive.lora`,
`calc.derive.quantized`)."""

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
