"""Every table the precompute jobs write and the app reads: names, columns and DDL in one place.

One row per (prototype, example) for evidence, parallel token/activation arrays for contexts, snake_case columns,
the vocabulary of the library (prototype_id, activation, contribution, ...). Each job owns its tables; the view
`prototypes` joins what the jobs wrote into the one row a prototype card needs.
"""

from __future__ import annotations

import duckdb

SCHEMA_VERSION = 3  # 2: labels.sibling_score and label_siblings (issue 14); 3: labels.fires_on, pushes, topic and
# the detection scores (issue 37). create_all upgrades an older file in place

# job -> the tables it owns (cleared when the job is re-run with --overwrite)
JOB_TABLES: dict[str, tuple[str, ...]] = {
    "evidence": ("documents", "evidence", "prototype_stats", "coactivations", "next_tokens", "logit_signatures"),
    "bands": ("band_documents", "evidence_bands"),
    "labels": ("labels", "label_siblings"),
    "search": ("embeddings",),
    "map": ("prototype_map",),
    "presets": ("presets",),
    "attribution": ("attribution_documents", "attribution_sequences", "attribution_factors", "attribution_vectors"),
}
JOBS = tuple(JOB_TABLES)
# What `python -m precompute build` runs unless --jobs names them: every job but attribution, which is opt-in (a
# pass over every training sequence plus a curvature fit; precompute/attribution/).
DEFAULT_JOBS = tuple(job for job in JOBS if job != "attribution")

# The columns of both document tables (documents, attribution_documents): one row per corpus document.
DOCUMENT_COLUMNS = """
            doc_id VARCHAR PRIMARY KEY,
            source VARCHAR NOT NULL,          -- wiki | news | kjv | fineweb | local | ...
            url VARCHAR,
            title VARCHAR,
            text VARCHAR,                     -- NULL in a pointer-only database
            sha256 VARCHAR NOT NULL,
            n_chars INTEGER NOT NULL,
            n_tokens INTEGER NOT NULL
        """

# The columns of both evidence tables (evidence, evidence_bands): one row per (prototype, kept token position). The
# model's input sequence was the document's tokens [seq_token_start, seq_token_end); token_position indexes them.
EVIDENCE_COLUMNS = """
            prototype_id INTEGER NOT NULL,
            rank INTEGER NOT NULL,            -- 0 = highest activation
            doc_id VARCHAR NOT NULL,
            token_position INTEGER NOT NULL,
            seq_token_start INTEGER NOT NULL,
            seq_token_end INTEGER NOT NULL,
            char_start INTEGER NOT NULL,      -- the token's characters in the document text
            char_end INTEGER NOT NULL,
            activation DOUBLE NOT NULL,
            token_id INTEGER NOT NULL,
            token VARCHAR NOT NULL,
            next_token_id INTEGER,            -- the document's next token (NULL at the end of the document)
            context_start INTEGER NOT NULL,   -- token position of the first context token
            context_tokens VARCHAR[] NOT NULL,      -- token texts; empty in pointer-only databases
            context_activations DOUBLE[] NOT NULL,  -- this prototype's activation at each context token
            context_char_starts INTEGER[] NOT NULL, -- each context token's characters in the document text
            context_char_ends INTEGER[] NOT NULL,
            PRIMARY KEY (prototype_id, rank)
        """

DDL = {
    # One row per job run: its arguments, so a re-run with other arguments is refused unless --overwrite.
    "runs": """
        CREATE TABLE IF NOT EXISTS runs (
            job VARCHAR PRIMARY KEY,
            run_id VARCHAR NOT NULL,          -- sha256 of job + args_json
            args_json VARCHAR NOT NULL,
            status VARCHAR NOT NULL,          -- running | done
            created_at TIMESTAMP NOT NULL,
            finished_at TIMESTAMP
        )""",
    # Resumable progress of a job: opaque state keyed by (job, key), written in the same transaction as the rows
    # it accounts for, so a killed job never loses or repeats work.
    "progress": """
        CREATE TABLE IF NOT EXISTS progress (
            job VARCHAR NOT NULL,
            key VARCHAR NOT NULL,
            value VARCHAR NOT NULL,
            PRIMARY KEY (job, key)
        )""",
    "meta": """
        CREATE TABLE IF NOT EXISTS meta (
            key VARCHAR PRIMARY KEY,
            value VARCHAR NOT NULL
        )""",
    # Documents the evidence points into. text is NULL in pointer-only mode (shipped databases): it is read
    # from the installed corpus package at run time and checked against sha256.
    "documents": f"CREATE TABLE IF NOT EXISTS documents ({DOCUMENT_COLUMNS})",
    # Top-N activating token positions per prototype. The model's input sequence was the document's tokens
    # [seq_token_start, seq_token_end); token_position indexes the document's tokens.
    "evidence": f"CREATE TABLE IF NOT EXISTS evidence ({EVIDENCE_COLUMNS})",
    # A uniform sample of each prototype's active positions (precompute/bands.py), for contexts from across the
    # activation range: the evidence table's columns (rank: 0 = the highest activation among the sampled rows),
    # its documents in band_documents.
    "band_documents": f"CREATE TABLE IF NOT EXISTS band_documents ({DOCUMENT_COLUMNS})",
    "evidence_bands": f"CREATE TABLE IF NOT EXISTS evidence_bands ({EVIDENCE_COLUMNS})",
    "prototype_stats": """
        CREATE TABLE IF NOT EXISTS prototype_stats (
            prototype_id INTEGER PRIMARY KEY,
            activation_count BIGINT NOT NULL, -- tokens where the prototype is active (in the top-k, a > 0)
            mean_activation DOUBLE,           -- over those tokens
            max_activation DOUBLE,
            hist_edges DOUBLE[] NOT NULL,
            hist_counts BIGINT[] NOT NULL
        )""",
    "coactivations": """
        CREATE TABLE IF NOT EXISTS coactivations (
            prototype_id INTEGER NOT NULL,
            other_id INTEGER NOT NULL,
            count BIGINT NOT NULL,            -- tokens where both are active
            rank INTEGER NOT NULL,
            PRIMARY KEY (prototype_id, rank)
        )""",
    "next_tokens": """
        CREATE TABLE IF NOT EXISTS next_tokens (
            prototype_id INTEGER NOT NULL,
            rank INTEGER NOT NULL,
            token_id INTEGER NOT NULL,
            token VARCHAR NOT NULL,
            count INTEGER NOT NULL,           -- how often it follows the prototype's evidence tokens
            PRIMARY KEY (prototype_id, rank)
        )""",
    "logit_signatures": """
        CREATE TABLE IF NOT EXISTS logit_signatures (
            prototype_id INTEGER NOT NULL,
            rank INTEGER NOT NULL,
            token_id INTEGER NOT NULL,
            token VARCHAR NOT NULL,
            value DOUBLE NOT NULL,            -- (W p_i)[token]
            PRIMARY KEY (prototype_id, rank)
        )""",
    "labels": """
        CREATE TABLE IF NOT EXISTS labels (
            prototype_id INTEGER PRIMARY KEY,
            category VARCHAR NOT NULL,        -- one of CATEGORIES
            label VARCHAR NOT NULL,           -- short specific role
            label_score DOUBLE,               -- how well the label separates held-out evidence from random (AUROC)
            labeler VARCHAR NOT NULL,
            explanation VARCHAR,
            sibling_score DOUBLE,             -- the same AUROC against the siblings' held-out evidence only
            fires_on VARCHAR,                 -- where it fires (labeler v3; NULL from labelers that do not say)
            pushes VARCHAR,                   -- what it pushes the next token toward
            topic VARCHAR,                    -- the specific topic under the category, "religion - scripture"
            detection_random DOUBLE,          -- held-out detection balanced accuracy vs random contexts
            detection_sibling DOUBLE          -- the same vs the siblings' held-out contexts
        )""",
    # A prototype's siblings (precompute/labels/contrast.py): prototypes whose evidence shares its tokens, strongest
    # first, with what separates the two (the facts that lead in each).
    "label_siblings": """
        CREATE TABLE IF NOT EXISTS label_siblings (
            prototype_id INTEGER NOT NULL,
            rank INTEGER NOT NULL,
            sibling_id INTEGER NOT NULL,
            overlap DOUBLE NOT NULL,          -- sum over tokens of the smaller share of the two prototypes' evidence
            separation VARCHAR NOT NULL,      -- e.g. "this: after 'of' · #12: before 'LORD'"
            PRIMARY KEY (prototype_id, rank)
        )""",
    "embeddings": """
        CREATE TABLE IF NOT EXISTS embeddings (
            kind VARCHAR NOT NULL,            -- label | evidence
            prototype_id INTEGER NOT NULL,
            item INTEGER NOT NULL,            -- 0 for labels, evidence rank for evidence
            vector FLOAT[] NOT NULL,          -- L2-normalised
            PRIMARY KEY (kind, prototype_id, item)
        )""",
    # Named intervention presets (precompute/presets.py): one row per (preset, prototype) with why it was chosen.
    "presets": """
        CREATE TABLE IF NOT EXISTS presets (
            name VARCHAR NOT NULL,
            prototype_id INTEGER NOT NULL,
            reasons VARCHAR[] NOT NULL,       -- label | next_token | signature
            PRIMARY KEY (name, prototype_id)
        )""",
    "prototype_map": """
        CREATE TABLE IF NOT EXISTS prototype_map (
            prototype_id INTEGER PRIMARY KEY,
            x DOUBLE NOT NULL,
            y DOUBLE NOT NULL,
            method VARCHAR NOT NULL
        )""",
    # Training-data attribution (precompute/attribution/, prism/attribution.py). The documents the training
    # sequences come from; text NULL in pointer-only databases, as in documents.
    "attribution_documents": f"CREATE TABLE IF NOT EXISTS attribution_documents ({DOCUMENT_COLUMNS})",
    # One row per training sequence: an evidence-job window, the document's tokens [seq_token_start,
    # seq_token_end) and characters [char_start, char_end).
    "attribution_sequences": """
        CREATE TABLE IF NOT EXISTS attribution_sequences (
            sequence_id INTEGER PRIMARY KEY,
            doc_id VARCHAR NOT NULL,
            seq_token_start INTEGER NOT NULL,
            seq_token_end INTEGER NOT NULL,
            char_start INTEGER NOT NULL,
            char_end INTEGER NOT NULL,
            n_targets INTEGER NOT NULL,       -- tokens whose next token is inside the sequence (the loss terms)
            loss DOUBLE NOT NULL              -- their summed cross-entropy
        )""",
    # The curvature and the projection as named matrices, one row per matrix row: coactivation (K x K, A),
    # output_vectors (d x d, eigenvectors of S as columns), output_values (1 x d), basis (d x r, the shared
    # projection B), damping (1 x 1, the absolute lambda).
    "attribution_factors": """
        CREATE TABLE IF NOT EXISTS attribution_factors (
            name VARCHAR NOT NULL,
            row INTEGER NOT NULL,
            "values" FLOAT[] NOT NULL,
            PRIMARY KEY (name, row)
        )""",
    # Per (prototype, training sequence) where the prototype is active: the cached vector (r floats: the whitened
    # smooth part of the sequence's gradient row, projected on the basis) and, parallel, every position in the
    # sequence (counted from seq_token_start) where the prototype is active, its activation there and the token
    # predicted there (the gradient's one-hot part, kept exactly).
    "attribution_vectors": """
        CREATE TABLE IF NOT EXISTS attribution_vectors (
            prototype_id INTEGER NOT NULL,
            sequence_id INTEGER NOT NULL,
            vector FLOAT[] NOT NULL,
            token_positions INTEGER[] NOT NULL,
            activations FLOAT[] NOT NULL,
            target_ids INTEGER[] NOT NULL,
            PRIMARY KEY (prototype_id, sequence_id)
        )""",
}

# The paper's taxonomy of prototype categories, in its order (docs/DESIGN.md section 6).
CATEGORIES = (
    "morphology", "grammatical scaffolding", "medical/bio", "institutional", "numbers/time", "science/tech",
    "named entities", "social", "boilerplate", "environment", "urls", "finance", "misc",
)

LABEL_COLUMNS_V3 = (("fires_on", "VARCHAR"), ("pushes", "VARCHAR"), ("topic", "VARCHAR"),
                    ("detection_random", "DOUBLE"), ("detection_sibling", "DOUBLE"))

PROTOTYPES_VIEW = """
    CREATE OR REPLACE VIEW prototypes AS
    SELECT s.prototype_id, l.label, l.category, l.label_score, l.sibling_score, s.activation_count,
           s.mean_activation, s.max_activation, m.x, m.y, s.hist_edges, s.hist_counts
    FROM prototype_stats s
    LEFT JOIN labels l USING (prototype_id)
    LEFT JOIN prototype_map m USING (prototype_id)
"""


def create_all(con: duckdb.DuckDBPyConnection) -> None:
    """Create every table (if missing), upgrade older files in place, and (re)create the prototypes view."""
    for ddl in DDL.values():
        con.execute(ddl)
    # version 1 -> 2: a labels table made before sibling_score (the column goes last, as in the DDL)
    con.execute("ALTER TABLE labels ADD COLUMN IF NOT EXISTS sibling_score DOUBLE")
    # version 2 -> 3: the two sides, the topic and the detection scores (in the DDL's order)
    for column, kind in LABEL_COLUMNS_V3:
        con.execute(f"ALTER TABLE labels ADD COLUMN IF NOT EXISTS {column} {kind}")
    con.execute(PROTOTYPES_VIEW)
    con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
