"""The web calculator's pages (``st.navigation`` in ``app.py``): calculator, planner, evidence."""
