"""The capacity planner (``calc.plan``): every configuration of the task, those that fit ranked."""

import pandas as pd
import streamlit as st

from calc import display
from webapp import form, planning, widgets

inputs: widgets.Inputs = st.session_state[widgets.INPUTS]
state = inputs.state
st.title("Capacity planner")
for error in inputs.errors:
    st.error(error, icon=":material/error:")
if inputs.model is None or inputs.job is None:
    st.stop()

if not state["plan.task"]:
    state["plan.task"] = "inference" if inputs.task == "infer" else "full-finetune"
for key in ("plan.task", "plan.global_batch", "plan.gpu_count", "plan.rank_by"):
    widgets.bind(key, state)
cols = st.columns(4)
cols[0].selectbox("task", form.PLAN_TASKS, key="plan.task")
cols[1].number_input(
    "global batch (sequences)",
    min_value=1,
    max_value=1 << 24,
    step=1,
    key="plan.global_batch",
    help="sequences per optimizer step over all GPUs (inference: sequences served)",
)
cols[2].number_input(
    f"number of {inputs.gpu.name}",
    min_value=1,
    max_value=form.MAX_GPU_COUNT,
    step=1,
    key="plan.gpu_count",
)
cols[3].selectbox("rank by", form.RANK_BYS, key="plan.rank_by")
for key in ("plan.task", "plan.global_batch", "plan.gpu_count", "plan.rank_by"):
    state[key] = st.session_state[key]
seq_len = inputs.job.seq_len if inputs.task == "train" else inputs.job.context
st.caption(
    f"{inputs.model.label}, sequence length {seq_len} (from the sidebar), "
    f"{state['plan.gpu_count']} x {inputs.gpu.name}. The planner enumerates precision x "
    "optimizer x recompute x micro-batch (and the parallelism and compression axes as they "
    "land) and evaluates every configuration with compiled, vectorised expressions."
)

request = planning.Request(
    model_key=planning.model_key(inputs.model),
    task=state["plan.task"],
    seq_len=seq_len,
    global_batch=state["plan.global_batch"],
    gpu=inputs.gpu.id,
    gpu_count=state["plan.gpu_count"],
    rank_by=state["plan.rank_by"],
    device=inputs.device,
)
try:
    planning.precompile(inputs.model, request)
    result = planning.plan(inputs.model, request)
except (ValueError, NotImplementedError) as exc:
    st.warning(f"the planner cannot answer this: {exc}", icon=":material/construction:")
    st.stop()

(st.success if result.best is not None else st.error)(result.verdict())
st.subheader(f"{len(result.fitting)} of {result.n_configurations} configurations fit")
if result.fitting:
    st.dataframe(
        pd.DataFrame(display.plan_rows(result.ranked(state["plan.rank_by"]))).drop(
            columns="reason"
        ),
        hide_index=True,
        width="stretch",
        column_config=planning.COLUMNS,
    )
with st.expander(f"{len(result.excluded)} excluded, with the reason each fails"):
    st.dataframe(
        pd.DataFrame(display.plan_rows(result.excluded)),
        hide_index=True,
        width="stretch",
        column_config=planning.COLUMNS,
    )

st.subheader("What is the least hardware for this?")
least = planning.least_hardware(inputs.model, request)
st.markdown(planning.least_hardware_text(least, inputs.gpu))

st.subheader("What to change to fit (the sidebar's job)")
changes = planning.changes_to_fit(inputs.model, request, inputs.job)
if changes is None:
    st.info("The sidebar's job already fits.")
elif not changes:
    st.warning("No change of one or two knobs makes it fit on this hardware.")
else:
    st.markdown("\n".join(f"- {c.text()}" for c in changes))
