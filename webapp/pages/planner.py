"""The capacity planner (``calc.plan``): every configuration of the task, those that fit ranked."""

import pandas as pd
import streamlit as st

from calc.present import display
from webapp import cached, form, planning, widgets

inputs: widgets.Inputs = st.session_state[widgets.INPUTS]
state = inputs.state
st.title("Capacity planner")
for error in inputs.errors:
    st.error(error, icon=":material/error:")
if inputs.model is None or inputs.job is None:
    st.stop()

if not state["plan.task"]:
    state["plan.task"] = planning.default_task(inputs.task)
KEYS = ("plan.task", "plan.global_batch", "plan.gpu_count", "plan.rank_by", "plan.explore")
for key in KEYS:
    widgets.bind(key, state)
cols = st.columns([1, 1, 1, 1, 2])
cols[0].selectbox("task", form.PLAN_TASKS, key="plan.task")
cols[1].number_input(
    "global batch",
    min_value=1,
    max_value=1 << 24,
    step=1,
    key="plan.global_batch",
    help="sequences per optimizer step over all GPUs (inference: sequences served)",
)
cols[2].number_input(
    f"GPUs ({inputs.gpu.id})", min_value=1, max_value=form.MAX_GPU_COUNT, step=1,
    key="plan.gpu_count",
)  # fmt: skip
cols[3].selectbox("rank by", form.RANK_BYS, key="plan.rank_by")
cols[4].multiselect(
    "explore",
    planning.explorable(st.session_state["plan.task"]),
    key="plan.explore",
    help="axes to enumerate (with the micro-batch); the others keep the sidebar's values. "
    "Each new structure compiles once (0.3-0.8 s), then comes from calc's persistent cache.",
)
for key in KEYS:
    state[key] = st.session_state[key]

request = planning.page_request(
    cached.model_key(inputs.model), state, inputs.task, inputs.gpu.id, inputs.device, inputs.job,
    spec=inputs.model.spec,
)  # fmt: skip
held_here = [
    a for a in planning.held_by(inputs.model.spec, request.task) if a in state["plan.explore"]
]
if held_here:
    st.info(
        f"{inputs.model.label} is derived from transformers' modeling code: each training "
        "structure is recorded from it (seconds each), so "
        f"{' and '.join(held_here)} stay at the sidebar's values; the planner enumerates the "
        "rest.",
        icon=":material/info:",
    )
try:
    planning.precompile(inputs.model, request)
    result = planning.plan(inputs.model, request)
except (ValueError, NotImplementedError) as exc:
    st.warning(f"the planner cannot answer this: {exc}", icon=":material/construction:")
    st.stop()

varying, held = planning.enumerated_and_held(result)
st.caption(
    f"{inputs.model.label}, {request.seq_len} tokens per sequence (sidebar), "
    f"{state['plan.gpu_count']} x {inputs.gpu.name}. Enumerated: "
    f"{' x '.join(varying) or 'nothing'}; the same in every configuration: "
    f"{', '.join(f'{axis}={value}' for axis, value in held.items()) or 'nothing'}."
)
(st.success if result.best is not None else st.error)(result.verdict())
st.subheader(f"{len(result.fitting)} of {result.n_configurations} configurations fit")
if result.fitting:
    table = pd.DataFrame(display.plan_rows(result.ranked(state["plan.rank_by"])))
    # an axis with one value in every configuration is in the caption; every other is a column
    same = [c for c in held if c in table.columns]
    st.dataframe(
        table.drop(columns=["reason", *same]),
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
st.markdown(planning.least_hardware_text(planning.least_hardware(inputs.model, request)))

st.subheader("What to change to fit (the sidebar's job)")
if cached.evaluate(inputs.model, request.model_key, inputs.job, inputs.gpu.id, inputs.device).fits:
    st.info("The sidebar's job already fits on one GPU.", icon=":material/check_circle:")
elif not st.toggle(
    "search (one knob, then pairs: compiles each structure it tries once, about 20 s the first time)",
    key="plan.changes",
):
    st.caption("Switch on the search to list the smallest changes that make the job fit.")
else:
    changes = planning.changes_to_fit(inputs.model, request, inputs.job)
    if changes:
        st.markdown("\n".join(f"- {c.text()}" for c in changes))
    else:
        st.warning("No change of one or two knobs makes it fit on this hardware.")
