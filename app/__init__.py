"""The PRISM studio app: generation with per-token prototype decomposition, evidence, interventions, a browser.

Layers (imports point one way, app -> precompute -> prism):
    app/assets.py        where the shipped default model and database live (the one place that knows)
    app/errors.py        AppError, a problem the user can fix, shown as is
    app/limits.py        what one user may cost a public app, and the request limiter in front of the queue
    app/database.py      the read-only database connection every user shares
    app/session.py       one user's interventions and generations (a value kept in gr.State)
    app/core.py          the UI-independent logic: generation with decomposition, side-by-side diffs, cards, search
    app/share.py, export.py, controllers.py, attribution.py   links, files, controllers, training data (no UI)
    app/plots.py, render.py                                    plotly figures and HTML
    app/messages.py      status lines and the guard every handler wears (no raw exception reaches a user)
    app/handlers.py      one plain function per UI action (each also an HTTP endpoint); app/interventions.py
                         holds the interventions panel's
    app/ui.py            the one Blocks layout wiring the handlers, and launch
Run `python app.py --help`.
"""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # the app never phones home, however it is imported
