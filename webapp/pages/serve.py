"""Serve: what a vLLM server holds per GPU after start-up (``calc.serve``), inputs as vLLM's
flags, the GPU's memory as a stacked bar, and the concurrency at each context length."""

import streamlit as st

import calc
from calc.config import serving as cfg
from calc.present import serving as rows
from webapp import charts, widgets

inputs: widgets.Inputs = st.session_state[widgets.INPUTS]
st.title("Serve with vLLM")
for error in inputs.errors:
    st.error(error, icon=":material/error:")
if inputs.model is None:
    st.stop()
model, gpu = inputs.model.spec, inputs.gpu
st.caption(f"**{inputs.model.label}** on {gpu.name}, per GPU, as vLLM logs it at start-up")

c = st.columns(4)
version = c[0].selectbox("vLLM version", cfg.RELEASES, index=cfg.RELEASES.index(cfg.DEFAULT_VLLM_VERSION), key="serve.version")  # fmt: skip
util = c[1].number_input("--gpu-memory-utilization", 0.05, 1.0, 0.9, 0.01, key="serve.util")
max_len = c[2].number_input("--max-model-len", 1, model.max_positions, min(model.max_positions, 8192), key="serve.max_len")  # fmt: skip
entry = c[3].selectbox("entry point", cfg.ENTRYPOINTS, key="serve.entrypoint")
c = st.columns(4)
seqs = c[0].number_input("--max-num-seqs (0: default)", 0, 1 << 16, 0, key="serve.seqs")
batched = c[1].number_input("--max-num-batched-tokens (0: default)", 0, 1 << 24, 0, key="serve.batched")  # fmt: skip
tp = c[2].number_input("--tensor-parallel-size", 1, 64, 1, key="serve.tp")
pp = c[3].number_input("--pipeline-parallel-size", 1, 64, 1, key="serve.pp")
c = st.columns(5)
dtype = c[0].selectbox("--dtype", cfg.SERVING_DTYPES, key="serve.dtype")
kv_dtype = c[1].selectbox("--kv-cache-dtype", cfg.KV_CACHE_DTYPES, key="serve.kv_dtype")
quant = c[2].selectbox("--quantization", ("from config.json", *cfg.SERVING_QUANTS), key="serve.quant")  # fmt: skip
block = c[3].selectbox("--block-size", ("default", *cfg.BLOCK_SIZES), key="serve.block")
eager = c[4].checkbox("--enforce-eager", key="serve.eager")
total_gib = None
if gpu.cuda_total_bytes is None:
    total_gib = st.number_input(
        f"total GPU memory vLLM logs for {gpu.name} (GiB): the catalog has no published reading",
        1.0, 4096.0, gpu.total_bytes / calc.GIB, key="serve.total_gib",
    )  # fmt: skip

try:
    serving = calc.Serving(
        vllm_version=version, gpu_memory_utilization=util, max_model_len=int(max_len),
        max_num_seqs=int(seqs) or None, max_num_batched_tokens=int(batched) or None,
        tensor_parallel=int(tp), pipeline_parallel=int(pp), dtype=dtype,
        kv_cache_dtype=kv_dtype, quant=None if quant == "from config.json" else quant,
        block_size=None if block == "default" else int(block),
        enforce_eager=eager, entrypoint=entry,
    )  # fmt: skip
    target = {"total_bytes": round(total_gib * calc.GIB)} if total_gib else {"gpu": gpu.id}
    served = inputs.model.config or model  # a config keeps its quantization_config
    est = calc.serve(served, serving, **target)
    curve = rows.concurrency_rows(
        served, serving, rows.context_lengths(model.max_positions), **target
    )
except (ValueError, NotImplementedError) as exc:
    st.error(str(exc), icon=":material/error:")
    st.stop()

m = st.columns(4)
m[0].metric("GPU KV cache size", f"{est.kv_cache_tokens:,} tokens")
m[1].metric(f"max concurrency at {est.max_model_len:,} tokens", f"{est.max_concurrency:.2f}x")
m[2].metric("available KV cache memory", f"{est.kv_cache_bytes / calc.GIB:.2f} GiB")
m[3].metric(
    "engine", f"{est.engine}, {est.max_num_batched_tokens} tokens x {est.max_num_seqs} seqs"
)
failure = rows.startup_failure(est)
if failure:
    st.error(f"vLLM does not start: {failure}", icon=":material/error:")
st.vega_lite_chart(charts.serve_bar_chart(rows.term_rows(est)), use_container_width=True)
st.dataframe(rows.term_rows(est), hide_index=True, column_order=("term", "GiB"))
st.subheader("Concurrency against context length")
st.vega_lite_chart(charts.concurrency_chart(curve), use_container_width=True)
with st.expander("assumptions"):
    for note in est.notes:
        st.markdown(f"- {note}")
