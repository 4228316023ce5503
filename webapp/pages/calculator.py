"""The calculator: peak per GPU, verdict, breakdown, phases, formula, sweeps."""

import dataclasses

import pandas as pd
import streamlit as st

import calc
from calc.present import device, display
from calc.present.sweep import SWEEP_FIELDS
from webapp import cached, charts, planning, prefetch, widgets

inputs: widgets.Inputs = st.session_state[widgets.INPUTS]
for error in inputs.errors:
    st.error(error, icon=":material/error:")
if inputs.model is None or inputs.job is None:
    st.stop()

MAX_CHART_RANKS = 64  # more ranks than this: the table only (a bar each would not fit)
model, job, gpu, parallel = inputs.model, inputs.job, inputs.gpu, inputs.parallel
key = cached.model_key(model)


def _short(value: object) -> str:
    if isinstance(value, calc.Distill):  # the teacher's spec is long: name it
        changed = [
            f"{f.name}={getattr(value, f.name)}"
            for f in dataclasses.fields(value)[1:]
            if getattr(value, f.name) != f.default
        ]
        return f"Distill(teacher={value.teacher.name}{''.join(', ' + c for c in changed)})"
    return repr(value) if isinstance(value, str) else str(value)


def _changed(obj: object) -> str:
    """``field=value`` for the fields of a job or layout that differ from the class default."""
    return ", ".join(
        f"{f.name}={_short(getattr(obj, f.name))}"
        for f in dataclasses.fields(obj)  # type: ignore[arg-type]
        if f.default is dataclasses.MISSING or getattr(obj, f.name) != f.default
    )


def _parameters(spec: calc.ModelSpec) -> str:
    """The caption's parameter count; a model transformers cannot build here (or without
    transformers installed) gets none: the estimate below says why."""
    try:
        return f"{calc.param_count(spec):,} parameters"
    except NotImplementedError:
        return "parameters not counted"


st.title("vramplan")
st.caption(
    f"**{model.label}**, {_parameters(model.spec)} · "
    f"{type(job).__name__}({_changed(job)})"
    + (f" · Parallelism({_changed(parallel)}), {parallel.world_size} GPUs" if parallel else "")
    + f" · predicting {'torch.cuda.max_memory_allocated' if inputs.device == 'cuda' else 'the CPU tracker'}"
)
try:
    est = cached.estimate(model, job, parallel, inputs.device, gpu.id)
except ValueError as exc:  # e.g. a layout that does not divide the model
    st.error(str(exc), icon=":material/error:")
    st.stop()
except calc.RecorderMissing as exc:  # the app's install has no torch: say what to add
    st.warning(str(exc), icon=":material/download:")
    st.stop()
except NotImplementedError as exc:
    st.warning(f"not modelled yet: {exc}", icon=":material/construction:")
    st.stop()
except OverflowError:
    st.error(
        "the model's sizes are too large: a tensor's bytes do not fit in 64 bits "
        "(check hidden_size, num_hidden_layers, vocab_size, ... in the config)",
        icon=":material/error:",
    )
    st.stop()

evaluated = None if parallel else cached.evaluate(model, key, job, gpu.id, inputs.device)
if evaluated is not None and evaluated.peak_bytes is not None:
    fits, verdict = evaluated.fits, evaluated.verdict()
else:  # a parallel layout (calc.plan.planner.evaluate is single-GPU: the most-loaded rank's
    # estimate), or a job the planner's tables refuse that calc.estimate derived
    fits, verdict = cached.estimate_verdict(model, job, est, gpu, parallel)
columns = st.columns(4 if parallel else 3)
columns[0].metric(
    "peak per GPU",
    f"{display.gib(est.peak_bytes):.2f} GiB",
    help="the most-loaded rank's peak" if parallel else None,
)
usable_gib = display.gib(gpu.usable_for(parallel))
columns[1].metric(
    f"{gpu.name}, usable",
    f"{usable_gib:.2f} GiB",
    help="the total less the memory outside PyTorch (upper end): see 'On the device' below",
)
columns[2].metric("peak phase", est.peak_phase, help=f"at the allocation of {est.peak_event}")
if parallel:
    columns[3].metric("most-loaded rank", str(est.rank), help=f"of {parallel.world_size} GPUs")
(st.success if fits else st.error)(
    verdict, icon=":material/check_circle:" if fits else ":material/cancel:"
)

with st.expander("On the device: allocated, reserved, outside PyTorch and total", expanded=True):
    st.markdown(
        device.markdown_table(device.device_rows(est.peak_bytes, gpu, parallel, inputs.device))
    )
    if parallel is None and inputs.device == "cuda":
        if st.toggle(
            "replay the caching allocator: reserved memory for both allocator settings (seconds)",
            key="replay_allocator",
        ):
            fit_rows = device.reserved_rows(cached.device_fits(model, key, job, gpu.id))
            st.markdown(device.markdown_table(fit_rows))
            st.caption(
                "Reserved memory is modelled from PyTorch's CUDACachingAllocator source and "
                "checked against H200 runs (verify/measurements/); 'nvidia-smi' = reserved "
                "+ outside PyTorch (upper end)."
            )

gpu_label = f"{gpu.name}: {usable_gib:.1f} GiB"
st.subheader("What is live at the peak")
st.vega_lite_chart(
    charts.breakdown_chart(display.stacked_levels(est), usable_gib, gpu_label),
    width="stretch",
)
with st.expander("breakdown table"):
    rows = display.breakdown_rows(est)
    table = pd.DataFrame(
        {
            "component": [r["label"] for r in rows],
            "GiB": [r["gib"] for r in rows],
            "% of peak": [r["share_pct"] for r in rows],
            "bytes": [r["bytes"] for r in rows],
        }
    )
    st.dataframe(
        table,
        hide_index=True,
        width="stretch",
        column_config={
            "GiB": st.column_config.NumberColumn(format="%.3f"),
            "% of peak": st.column_config.NumberColumn(format="%.1f"),
        },
    )

if parallel and est.rank_peaks:
    st.subheader("Peak of every rank")
    peaks = sorted(est.rank_peaks.items())
    ranks = pd.DataFrame(
        {
            "rank": [r for r, _ in peaks],
            "GiB": [display.gib(b) for _, b in peaks],
            "bytes": [b for _, b in peaks],
        }
    )
    if len(peaks) <= MAX_CHART_RANKS:
        st.vega_lite_chart(
            charts.rank_chart(ranks.to_dict("records"), usable_gib, gpu_label),
            width="stretch",
        )
    with st.expander("rank table"):
        st.dataframe(
            ranks,
            hide_index=True,
            width="stretch",
            column_config={"GiB": st.column_config.NumberColumn(format="%.3f")},
        )
st.subheader("Phases of the step")
st.vega_lite_chart(
    charts.phases_chart(display.phase_rows(est), usable_gib, gpu_label), width="stretch"
)

st.subheader("Formula")
st.caption(
    "The bytes live at the peak allocation: each term is (count) x (tensor size rounded up to "
    "the allocator's 512-byte blocks). Evaluated at the values below it gives the peak."
)
st.latex(r"\text{peak} = " + display.latex_lines(est.peak_expression))
st.markdown(
    "| symbol | meaning | value |\n|---|---|---:|\n"
    + "\n".join(
        f"| ${r['symbol']}$ | {r['meaning']} | {r['value']:,} |"
        for r in display.symbol_rows(est, inference=isinstance(job, calc.Inference))
    )
)
if est.notes:
    st.caption("Assumptions: " + "; ".join(est.notes))

st.subheader("Sweeps")
if parallel:
    st.caption("sweeps are of one GPU: not shown for a parallel layout")
    st.stop()
seq_field, batch_field = SWEEP_FIELDS[type(job)]
columns = st.columns(2)
for column, field, title, high in (
    (
        columns[0],
        seq_field,
        "sequence length (tokens)" if inputs.task == "train" else "context (tokens)",
        1 << 20,
    ),
    (columns[1], batch_field, "micro-batch" if inputs.task == "train" else "batch", 1 << 12),
):
    current = getattr(job, field)
    result = cached.size_sweep(model, key, job, field, current, high, inputs.device)
    with column:
        st.vega_lite_chart(
            charts.sweep_chart(
                display.sweep_rows(result), field, title, usable_gib, gpu_label, current
            ),
            width="stretch",
        )
        if result.errors:
            st.caption("not shown: " + "; ".join(result.errors))

# The structures one choice away from this job compile in the background (webapp/prefetch.py),
# so the next change of precision, optimizer, recompute, kernel or modeling code reruns fast.
prefetch.warm(model.spec, key, job, parallel, inputs.device)
# and the planner page's structures for its current question, so that opening it is fast.
plan_request = planning.page_request(key, inputs.state, inputs.task, gpu.id, inputs.device, job)
prefetch.warm_plan(model.spec, plan_request, **planning.precompile_args(plan_request))
