"""The PRISM studio app: generation with per-token prototype decomposition, evidence, interventions, a browser.

Layers (imports point one way, app -> precompute -> prism):
    app/assets.py   where the shipped default model and database live (the one place that knows)
    app/session.py  one user's interventions and generations (a value kept in gr.State)
    app/core.py     the UI-independent logic: generation with decomposition, side-by-side diffs, cards, search
    app/plots.py    plotly figures
    app/limits.py   what one user may cost a public app, and the request limiter in front of the queue
    app/handlers.py one plain function per UI action (each also an HTTP endpoint); app/interventions.py: the
                    interventions panel's
    app/ui.py       the one Blocks layout wiring the handlers, and launch
Run `python app.py --help`.
"""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # the app never phones home, however it is imported
