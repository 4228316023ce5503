"""The published vLLM start-up logs of ``tests/data/vllm_startup_logs.json``, run through
``calc.serve``: shared by the tests and by ``python -m tests.calc.serving.published`` (the table
the report quotes)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import calc

DATA = Path(__file__).resolve().parents[2] / "data" / "vllm_startup_logs.json"
GIB = 1 << 30


@dataclass(frozen=True)
class Comparison:
    id: str
    version: str
    predicted_tokens: int
    logged_tokens: int
    estimate: calc.ServeEstimate
    logged: dict[str, Any]

    @property
    def error(self) -> float:
        """Relative error of the predicted KV cache size in tokens."""
        return (self.predicted_tokens - self.logged_tokens) / self.logged_tokens


def records() -> list[dict[str, Any]]:
    logs: list[dict[str, Any]] = json.loads(DATA.read_text())["logs"]
    return logs


def model_of(rec: dict[str, Any]) -> calc.ModelSpec:
    if "config" in rec:
        return calc.ModelSpec.from_hf_config(rec["config"], name=rec["id"])
    model = calc.load_card(rec["card"])
    if rec.get("card_overrides"):
        model = model.with_overrides(**rec["card_overrides"])
    return model


def compare(rec: dict[str, Any]) -> Comparison:
    serving = calc.Serving(vllm_version=rec["vllm_version"], **rec["serving"])
    if rec["total_gib"] is not None:
        est = calc.serve(model_of(rec), serving, total_bytes=round(rec["total_gib"] * GIB))
    else:
        est = calc.serve(model_of(rec), serving, gpu=rec["gpu"])
    logged = rec["logged"]
    return Comparison(
        rec["id"], rec["vllm_version"], est.kv_cache_tokens, logged["kv_cache_tokens"], est, logged
    )


def table() -> str:
    lines = [
        "| log | vLLM | predicted tokens | logged tokens | error |",
        "|---|---|---:|---:|---:|",
    ]
    for rec in records():
        c = compare(rec)
        lines.append(
            f"| {c.id} | {c.version} | {c.predicted_tokens:,} | {c.logged_tokens:,} | "
            f"{100 * c.error:+.2f} % |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
