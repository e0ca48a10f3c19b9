"""precompute: jobs that read a PRISM model and a corpus and write one DuckDB database, which the app reads.

    python -m precompute build --model runs/prism/final --corpus default --db out.duckdb

What the jobs read and the job interface are in inputs.py, the jobs in build order in jobs.py, the tables in
schema.py, what the app asks in query.py; docs/DESIGN.md section 5 describes the flow.
"""
