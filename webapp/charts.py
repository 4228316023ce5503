"""Vega-Lite specs of the web calculator's charts, drawn from ``calc.present.display`` rows (no
arithmetic here: the rows already hold GiB and shares).

Plain dicts for ``st.vega_lite_chart``: building them through Altair validated every spec
against the Vega-Lite JSON schema on each rerun (~30 ms per chart), most of a rerun's time.
"""

from __future__ import annotations

from collections.abc import Sequence

GPU_LINE_COLOR = "#d62728"
Spec = dict


def _gpu_rule(usable_gib: float, label: str, axis: str) -> list[Spec]:
    """Two layers: a dashed line at the GPU's usable memory and its label."""
    data = {"values": [{"gib": usable_gib, "label": label}]}
    pos = {axis: {"field": "gib", "type": "quantitative"}}
    rule = {
        "data": data,
        "mark": {"type": "rule", "color": GPU_LINE_COLOR, "strokeDash": [6, 3], "size": 2},
        "encoding": pos,
    }
    text_mark = {"type": "text", "color": GPU_LINE_COLOR, "align": "left", "dx": 4}
    if axis == "x":  # label left of the line, above the bars (the line may end the axis)
        text_mark.update({"align": "right", "dx": -4, "baseline": "bottom", "y": -4})
    else:
        text_mark.update({"dy": -6, "x": 0})
    text = {"data": data, "mark": text_mark, "encoding": {**pos, "text": {"field": "label"}}}
    return [rule, text]


def rank_chart(rows: Sequence[dict], usable_gib: float, gpu_label: str) -> Spec:
    """One horizontal bar per rank (``rank``, ``GiB``), with the GPU's line."""
    bars = {
        "data": {"values": list(rows)},
        "mark": {"type": "bar"},
        "encoding": {
            "x": {"field": "GiB", "type": "quantitative", "title": "peak GiB"},
            "y": {
                "field": "rank",
                "type": "ordinal",
                "title": "rank",
                "axis": {"labelOverlap": False},
            },
            "tooltip": [
                {"field": "rank", "type": "ordinal"},
                {"field": "GiB", "type": "quantitative", "format": ".3f"},
            ],
        },
    }
    return {
        "height": {"step": 22},
        "padding": {"left": 12},
        "layer": [bars, *_gpu_rule(usable_gib, gpu_label, "x")],
    }  # fmt: skip


def breakdown_chart(rows: Sequence[dict], usable_gib: float, gpu_label: str) -> Spec:
    """Horizontal stacked bars, one per level of the breakdown tree, with the GPU's line."""
    bars = {
        "data": {"values": list(rows)},
        "mark": {"type": "bar", "stroke": "white", "strokeWidth": 0.5},
        "encoding": {
            "x": {"field": "gib", "type": "quantitative", "aggregate": "sum",
                  "title": "GiB live at the peak"},
            "y": {"field": "level", "type": "nominal", "title": None, "sort": None},
            "color": {"field": "group", "type": "nominal", "title": "component",
                      "legend": {"orient": "bottom", "columns": 4}},
            "order": {"field": "order", "type": "quantitative"},
            "tooltip": [
                {"field": "component", "type": "nominal"},
                {"field": "gib", "type": "quantitative", "title": "GiB", "format": ".2f"},
                {"field": "share_pct", "type": "quantitative", "title": "% of peak",
                 "format": ".1f"},
            ],
        },
    }  # fmt: skip
    return {
        "height": {"step": 44},
        "padding": {"left": 12},
        "layer": [bars, *_gpu_rule(usable_gib, gpu_label, "x")],
    }


def phases_chart(rows: Sequence[dict], usable_gib: float, gpu_label: str) -> Spec:
    """The peak of each phase of the step, in step order, the peak phase highlighted."""
    bars = {
        "data": {"values": list(rows)},
        "mark": {"type": "bar"},
        "encoding": {
            "x": {"field": "phase", "type": "nominal", "sort": {"field": "order"},
                  "title": "phase of the step", "axis": {"labelAngle": 0}},
            "y": {"field": "gib", "type": "quantitative", "title": "peak GiB in the phase"},
            "color": {"condition": {"test": "datum.is_peak", "value": "#1f77b4"},
                      "value": "#9ecae1"},
            "tooltip": [
                {"field": "phase", "type": "nominal"},
                {"field": "gib", "type": "quantitative", "title": "GiB", "format": ".2f"},
            ],
        },
    }  # fmt: skip
    return {"height": 260, "layer": [bars, *_gpu_rule(usable_gib, gpu_label, "y")]}


def sweep_chart(
    rows: Sequence[dict], field: str, title: str, usable_gib: float, gpu_label: str,
    current: int,
) -> Spec:  # fmt: skip
    """Peak vs one size (log2 axis), the current value marked, with the GPU's line."""
    x = {"field": field, "type": "quantitative", "title": title,
         "scale": {"type": "log", "base": 2}}  # fmt: skip
    y = {"field": "gib", "type": "quantitative", "title": "peak GiB per GPU"}
    line = {
        "data": {"values": list(rows)},
        "mark": {"type": "line", "point": True},
        "encoding": {
            "x": x,
            "y": y,
            "tooltip": [
                {"field": field, "type": "quantitative"},
                {"field": "gib", "type": "quantitative", "title": "GiB", "format": ".2f"},
            ],
        },
    }
    now = {
        "data": {"values": [r for r in rows if r[field] == current]},
        "mark": {"type": "point", "size": 140, "filled": True, "color": "#ff7f0e"},
        "encoding": {"x": x, "y": y},
    }
    return {"height": 250, "layer": [line, now, *_gpu_rule(usable_gib, gpu_label, "y")]}


def evidence_chart(rows: Sequence[dict]) -> Spec:
    """Predicted vs measured peak (log-log), one point per compared case, the diagonal dashed."""
    compared = [r for r in rows if r["predicted_mib"] is not None and r["measured_mib"] is not None]
    ends = [min(r["measured_mib"] for r in compared), max(r["measured_mib"] for r in compared)]
    scale = {"type": "log"}
    diagonal = {
        "data": {"values": [{"mib": v} for v in ends]},
        "mark": {"type": "line", "color": "gray", "strokeDash": [4, 4]},
        "encoding": {
            "x": {"field": "mib", "type": "quantitative", "scale": scale},
            "y": {"field": "mib", "type": "quantitative", "scale": scale},
        },
    }
    points = {
        "data": {"values": compared},
        "mark": {"type": "point", "filled": True, "size": 70, "opacity": 0.8},
        "encoding": {
            "x": {"field": "measured_mib", "type": "quantitative", "scale": scale,
                  "title": "measured peak (MiB)"},
            "y": {"field": "predicted_mib", "type": "quantitative", "scale": scale,
                  "title": "predicted peak (MiB)"},
            "color": {"field": "implementation", "type": "nominal"},
            "shape": {"field": "kind", "type": "nominal"},
            "tooltip": [
                {"field": "case", "type": "nominal"},
                {"field": "status", "type": "nominal"},
                {"field": "predicted_mib", "type": "quantitative", "format": ".3f"},
                {"field": "measured_mib", "type": "quantitative", "format": ".3f"},
                {"field": "error_pct", "type": "quantitative", "format": "+.3f"},
            ],
        },
    }  # fmt: skip
    return {"height": 420, "layer": [diagonal, points]}


def serve_bar_chart(rows: Sequence[dict]) -> Spec:
    """One stacked horizontal bar: the GPU's memory split into the terms of a vLLM start-up
    (``calc.present.serving.term_rows``)."""
    return {
        "data": {"values": list(rows)},
        "mark": {"type": "bar"},
        "encoding": {
            "x": {"field": "GiB", "type": "quantitative", "stack": "zero", "title": "GiB"},
            "color": {"field": "term", "type": "nominal", "sort": {"field": "order"}},
            "order": {"field": "order", "type": "quantitative"},
            "tooltip": [
                {"field": "term", "type": "nominal"},
                {"field": "GiB", "type": "quantitative", "format": ".2f"},
            ],
        },
        "height": 60,
    }


def concurrency_chart(rows: Sequence[dict]) -> Spec:
    """Maximum concurrency against ``max_model_len`` (log-2 x axis), one point per length
    (``calc.present.serving.concurrency_rows``)."""
    return {
        "data": {"values": list(rows)},
        "mark": {"type": "line", "point": True},
        "encoding": {
            "x": {
                "field": "max_model_len", "type": "quantitative",
                "scale": {"type": "log", "base": 2}, "title": "max_model_len (tokens)",
            },
            "y": {"field": "concurrency", "type": "quantitative", "title": "max concurrency"},
            "tooltip": [
                {"field": "max_model_len", "type": "quantitative"},
                {"field": "concurrency", "type": "quantitative", "format": ".2f"},
                {"field": "kv_tokens", "type": "quantitative", "format": ","},
            ],
        },
    }  # fmt: skip
