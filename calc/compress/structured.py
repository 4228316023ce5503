"""Structured pruning: heads, FFN channels or whole layers removed leave a smaller dense model.

`pruned_spec` gives that model; every other term of the cost model then shrinks with it.
"""

from __future__ import annotations

from calc.config.model_spec import ModelSpec


def pruned_spec(
    model: ModelSpec,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    ffn: int | None = None,
    n_layers: int | None = None,
) -> ModelSpec:
    """The dense model left after structured pruning: attention heads removed (``n_heads``
    query heads kept, ``n_kv_heads`` key/value heads), FFN channels removed (``ffn`` kept) or
    whole layers dropped (``n_layers`` kept). Head width and hidden size stay, so the
    projections shrink to ``n_heads*head_dim`` rows (Michel et al. 2019, "Are Sixteen Heads
    Really Better than One?"; Sheared-LLaMA, Xia et al. 2023, prunes the same dimensions).

    Validated: each kept count is at least 1 and at most the model's; kept query heads must be
    a multiple of the kept KV heads (GQA groups stay whole); GPT-2's fused ``c_attn`` needs
    ``n_heads * head_dim == hidden``, so its heads cannot be pruned.
    """
    if not isinstance(model, ModelSpec):
        raise ValueError(f"model must be a calc.ModelSpec, got {type(model).__name__}")
    changes: dict[str, int] = {}
    for field, value, current in (
        ("n_heads", n_heads, model.n_heads),
        ("n_kv_heads", n_kv_heads, model.n_kv_heads),
        ("ffn", ffn, model.ffn),
        ("n_layers", n_layers, model.n_layers),
    ):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= current:
            raise ValueError(f"{field}={value!r} must be an integer in [1, {current}] (kept)")
        changes[field] = value
    heads = changes.get("n_heads", model.n_heads)
    kv = changes.get("n_kv_heads", model.n_kv_heads)
    if model.n_kv_heads == model.n_heads and "n_heads" in changes and "n_kv_heads" not in changes:
        kv = heads  # multi-head attention stays multi-head
        changes["n_kv_heads"] = kv
    if heads % kv:
        raise ValueError(
            f"n_heads={heads} must be a multiple of n_kv_heads={kv}: each kept KV head serves "
            f"a whole group of query heads (GQA)"
        )
    if model.model_type == "gpt2" and ("n_heads" in changes or "n_kv_heads" in changes):
        if heads != model.n_heads or kv != model.n_kv_heads:
            raise ValueError(
                f"n_heads={heads}: gpt2's fused c_attn needs n_heads * head_dim == hidden, "
                "so its heads cannot be pruned (prune ffn or layers)"
            )
    if not changes:
        return model
    return model.with_overrides(name=f"{model.name}-pruned", **changes)
