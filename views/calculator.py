"""The calculator: peak per GPU, verdict, breakdown, phases, formula, sweeps."""

import dataclasses

import pandas as pd
import streamlit as st

from calc import display
from calc.sweep import SWEEP_FIELDS
from webapp import cached, charts, widgets

inputs: widgets.Inputs = st.session_state[widgets.INPUTS]
for error in inputs.errors:
    st.error(error, icon=":material/error:")
if inputs.model is None or inputs.job is None:
    st.stop()

model, job, gpu = inputs.model, inputs.job, inputs.gpu
key = cached.model_key(model)
st.title("vramplan")
st.caption(
    f"**{model.label}**, {model.spec.n_params:,} parameters · "
    f"{type(job).__name__}("
    + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(job).items())
    + f") · predicting {'torch.cuda.max_memory_allocated' if inputs.device == 'cuda' else 'the CPU tracker'}"
)
try:
    est = cached.estimate(model, key, job, inputs.device)
except (ValueError, NotImplementedError) as exc:
    st.warning(f"not modelled yet: {exc}", icon=":material/construction:")
    st.stop()
except OverflowError:
    st.error(
        "the model's sizes are too large: a tensor's bytes do not fit in 64 bits "
        "(check hidden_size, num_hidden_layers, vocab_size, ... in the config)",
        icon=":material/error:",
    )
    st.stop()

verdict = cached.evaluate(model, key, job, gpu.id, inputs.device)
left, mid, right = st.columns(3)
left.metric("peak per GPU", f"{display.gib(est.peak_bytes):.2f} GiB")
mid.metric(f"{gpu.name}, usable", f"{gpu.usable_gib:.2f} GiB")
right.metric("peak phase", est.peak_phase, help=f"at the allocation of {est.peak_event}")
(st.success if verdict.fits else st.error)(
    verdict.verdict(), icon=":material/check_circle:" if verdict.fits else ":material/cancel:"
)

gpu_label = f"{gpu.name}: {gpu.usable_gib:.1f} GiB"
st.subheader("What is live at the peak")
st.vega_lite_chart(
    charts.breakdown_chart(display.stacked_levels(est), gpu.usable_gib, gpu_label),
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

st.subheader("Phases of the step")
st.vega_lite_chart(
    charts.phases_chart(display.phase_rows(est), gpu.usable_gib, gpu_label), width="stretch"
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
        f"| ${r['symbol']}$ | {r['meaning']} | {r['value']:,} |" for r in display.symbol_rows(est)
    )
)
if est.notes:
    st.caption("Assumptions: " + "; ".join(est.notes))

st.subheader("Sweeps")
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
                display.sweep_rows(result), field, title, gpu.usable_gib, gpu_label, current
            ),
            width="stretch",
        )
        if result.errors:
            st.caption("not shown: " + "; ".join(result.errors))
