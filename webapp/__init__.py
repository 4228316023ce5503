"""The web calculator's pieces that are not pages: the form (every input, its widget key, its
URL query parameter and its validation), the model source (card, pasted or uploaded
``config.json``) and the Streamlit widgets. ``app.py`` and ``pages/`` wire them to ``calc``.

Only ``webapp.widgets`` and the views import streamlit; ``webapp.form`` and ``webapp.model_source``
are plain Python (tested without a server).
"""
