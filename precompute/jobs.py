"""The precompute jobs, in the order `python -m precompute build` runs them. Each is a Job (precompute/inputs.py):
a name, an arguments dataclass and run(context).

    evidence     top activating contexts, statistics, co-activation, next tokens, logit signatures (every rank)
    bands        a uniform sample of each prototype's active positions: contexts across its activation range
    attribution  the training-data attribution cache (opt-in: not in schema.DEFAULT_JOBS)
    labels       a category, a label and two held-out scores per prototype; siblings
    search       label and evidence embeddings for semantic search
    map          a 2-D layout of the prototype bank
    presets      named intervention presets found by stated rules

    from precompute.jobs import REGISTRY
    REGISTRY["search"].run(Context(Inputs("out.duckdb"), SearchArgs()))

Later jobs read what earlier ones wrote; each refuses to run before the jobs it reads have finished.
"""

from __future__ import annotations

from precompute import attribution, bands, evidence, presets, search
from precompute import map as proto_map
from precompute.inputs import Job
from precompute.labels import job as labels

REGISTRY: dict[str, Job] = {job.name: job for job in (evidence.JOB, bands.JOB, attribution.JOB, labels.JOB, search.JOB,
                                                       proto_map.JOB, presets.JOB)}
