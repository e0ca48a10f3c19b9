"""The PRISM studio app: generation with per-token prototype decomposition, evidence, interventions, a browser.

Layers (imports point one way, app -> precompute -> prism):
    app/assets.py        where the shipped default model and database live (the one place that knows)
    app/errors.py        AppError, a problem the user can fix, shown as is
    app/limits.py        what one user may cost a public app, and the request limiter in front of the queue
    app/database.py      the read-only database every user shares, read through precompute/query.py: cards,
                         search, the table, presets, map points (no SQL here)
    app/generation.py    one user's generations as immutable values, and the diff of two texts
    app/session.py       one user's interventions and generations (a value kept in gr.State)
    app/core.py          the UI-independent logic: generation, and a token's explanation by one call into
                         prism/explain.py (decomposition, alternatives, carried share, what an intervention changed)
    app/share.py, export.py, controllers.py, attribution.py   links, files, controllers, training data (no UI)
    app/plots.py, render.py                                    plotly figures and HTML
    app/messages.py      status lines and the guard every handler wears (no raw exception reaches a user)
    app/panels.py        what each handler returns: one named tuple per panel, wired by field name
    app/handlers.py      one plain function per UI action (each also an HTTP endpoint); app/interventions.py
                         holds the interventions panel's
    app/ui.py            one small builder per panel, the wiring of every event, and launch
The README's pictures are made by tools/screenshots.py from the running app.
Run `python app.py --help`.
"""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # the app never phones home, however it is imported
