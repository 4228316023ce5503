"""vramplan's web calculator: ``streamlit run app.py`` (``bash scripts/run.sh`` does it).

The entry page draws the inputs (``webapp.widgets``: model, task, GPU, every job field; the
state mirrored into the URL) and hands over to the page chosen at the top: the calculator, the
capacity planner, or the verification evidence. No arithmetic here or in the pages: numbers come
from ``calc``.
"""

import streamlit as st

from webapp import prefetch, widgets

prefetch.page_started()  # background compiling waits while pages run (webapp/prefetch.py)
st.set_page_config(
    page_title="vramplan: GPU memory calculator", page_icon=":material/calculate:", layout="wide"
)
widgets.sidebar()
st.navigation(
    [
        st.Page(
            "webapp/pages/calculator.py",
            title="Calculator",
            icon=":material/calculate:",
            default=True,
        ),
        st.Page(
            "webapp/pages/planner.py",
            title="Planner",
            icon=":material/table_view:",
            url_path="planner",
        ),
        st.Page(
            "webapp/pages/serve.py",
            title="Serve",
            icon=":material/dns:",
            url_path="serve",
        ),
        st.Page(
            "webapp/pages/evidence.py",
            title="Verification",
            icon=":material/science:",
            url_path="verification",
        ),
    ],
    position="top",
).run()
