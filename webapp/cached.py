"""``calc`` calls cached across reruns and sessions (``st.cache_resource``): the compiled
expressions live in ``calc.estimate``'s cache, and the results of one set of inputs are kept so
that a rerun that changes nothing recomputes nothing."""

from __future__ import annotations

import json

import streamlit as st

import calc
from calc import plan
from calc.sweep import Sweep, doubling_values, sweep
from webapp.model_source import Model


def model_key(model: Model) -> str:
    """A hashable name of the model: the card id, or the custom config's canonical JSON."""
    if model.config is None:
        return f"card:{model.label}"
    return "config:" + json.dumps(model.config, sort_keys=True, separators=(",", ":"))


@st.cache_resource(max_entries=256, show_spinner="compiling the expressions of this job...")
def estimate(
    _model: Model, key: str, job: calc.Training | calc.Inference, device: str
) -> calc.Estimate:
    """``calc.estimate`` of the job (``key`` names the model for the cache)."""
    return calc.estimate(_model.spec, job, device=device)


@st.cache_resource(max_entries=256, show_spinner=False)
def evaluate(
    _model: Model, key: str, job: calc.Training | calc.Inference, gpu_id: str, device: str
) -> plan.Evaluated:
    """``calc.plan.evaluate``: the job against one GPU, its verdict with the error observed on
    the nearest verified cases (the same sentence as a planner row)."""
    return plan.evaluate(_model.spec, job, gpu=gpu_id, device=device)


@st.cache_resource(max_entries=256, show_spinner=False)
def size_sweep(
    _model: Model, key: str, job: calc.Training | calc.Inference, field: str, current: int,
    high: int, device: str,
) -> Sweep:  # fmt: skip
    """``calc.sweep.sweep`` over doubling values of ``field`` around ``current``."""
    values = doubling_values(current, high=high, points=9)
    return sweep(_model.spec, job, field, values, device=device)
