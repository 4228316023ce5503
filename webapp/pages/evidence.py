"""Verification evidence: the latest ``python -m verify`` report, predicted vs measured."""

import pandas as pd
import streamlit as st

from calc.present import display
from webapp import charts, evidence

st.title("Verification evidence")
report = evidence.load_report()
if report is None:
    st.error(
        f"no verify report at {evidence.REPORT}: run `python -m verify`", icon=":material/error:"
    )
    st.stop()

meta, summary = report.get("meta", {}), report.get("summary", {})
st.caption(
    "Each case builds a scaled-down real model, runs it in PyTorch under verify's CPU storage "
    "tracker, and compares the measured peak with "
    f"`calc.estimate(..., device={meta.get('device', 'cpu')!r})`. "
    + ", ".join(f"{k} {v}" for k, v in meta.items())
)
cols = st.columns(5)
cols[0].metric("cases", summary.get("cases"))
cols[1].metric("within tolerance", summary.get("within_tolerance"))
cols[2].metric("not modelled", summary.get("not_modelled"))
cols[3].metric("median |error|", f"{summary.get('median_abs_error_pct', 0):.3f}%")
cols[4].metric("max |error|", f"{summary.get('max_abs_error_pct', 0):.3f}%")

rows = display.evidence_rows(report)
frame = pd.DataFrame(rows)
st.subheader("Predicted vs measured peak, one point per case")
st.vega_lite_chart(charts.evidence_chart(rows), width="stretch")

missing = frame[frame["predicted_mib"].isna()]
if len(missing):
    st.subheader("Not modelled yet (listed, not compared)")
    st.dataframe(missing[["case", "implementation", "kind", "status"]], hide_index=True)

st.subheader("Every case")
status = st.multiselect(
    "status",
    sorted(frame["status"].dropna().unique()),
    key="evidence.status",
    placeholder="all statuses",
)
shown = frame[frame["status"].isin(status)] if status else frame
st.dataframe(
    shown,
    hide_index=True,
    width="stretch",
    column_config={
        "predicted_mib": st.column_config.NumberColumn("predicted MiB", format="%.3f"),
        "measured_mib": st.column_config.NumberColumn("measured MiB", format="%.3f"),
        "error_pct": st.column_config.NumberColumn("error %", format="%+.3f"),
        "tolerance_pct": st.column_config.NumberColumn("tolerance %", format="%.1f"),
    },
)
