"""The attribution job: cache per-training-sequence statistics so a token's training data is a sparse product.

    python -m precompute build --model runs/prism/final --corpus default --db out.duckdb --jobs attribution
    python -m precompute.attribution --model runs/prism/final --corpus default --db out.duckdb --max-sequences 4096

The training sequences are the evidence job's windows (precompute.inputs.document_windows: --seq-len tokens per
window, documents in corpus order), so every answer links to a document, a token span and a character span. The
math is in prism/attribution.py; this job runs it over the corpus in three passes:

1. fit: the model runs over every window once; per target token it keeps z, e = W^T (softmax - onehot), the
   active prototypes and activations in work files beside the database, and accumulates the curvature factors
   A (co-usage) and S (output side). Checkpointed atomically every --docs-per-chunk documents.
2. factors: the curvature is eigendecomposed, every sequence's whitened rows give the shared projection basis B
   (top --rank principal directions), and documents, sequences and factors are written in one transaction.
3. vectors: per (prototype, sequence) the cached vector (the whitened smooth part of the gradient row, projected
   on B) and, exactly, every position where the prototype is active with its activation and the token predicted
   there (the gradient's one-hot part), written in chunks; each chunk commits with its progress, so a killed job
   neither loses nor repeats rows.
4. exact store: every sequence's exact gradient rows (one per prototype active in it, the sum of its tokens'
   exact gradients) rotated into the eigenbasis of S, float16 with a scale per row, as .npy files in
   `<db>.attribution-exact/` (exact_folder), so the app can score a query's best candidates exactly (the
   reference's computation for them; prism.attribution.ExactStore). About 1.2 KB a row, some 170 rows a 64-token
   sequence (200 KB); computed from the fit pass's token files like the vectors, written atomically, so a
   killed job writes it again on resume.
5. gradient store (--attribution-grad-rank r, default 16; 0: none): the fit pass also runs the trained layers'
   backward from each token's e (no second vocabulary product) and keeps, per token, every trained linear layer's
   input and output gradient projected to r numbers (prism/grad_cache.py); this pass fits EK-FAC on the sequences'
   projected gradients and writes the factors sorted by predicted token, with the projections and the
   preconditioner, to `<db>.attribution-gradients/` (gradient_folder): the app's default reading (where a sequence
   predicted the same token, in the layers' gradients). 2 r M float16 numbers a token (M = 14 linear layers for
   two SmolLM2 layers: 896 bytes at r = 16); written atomically, last.

Cost: the fit pass is one forward pass of the whole model per window plus, per token, a softmax over the
vocabulary; its work files hold two d-vectors per token (about 4.7 KB per token for d = 576, 2.4 GB for 4096
windows of 128 tokens) and are deleted at the end. The later passes touch only those files. Measured on the
shipped default (3,072 windows of 64 tokens, 189k target tokens, rank 128, 2 CPU cores): 12 min 25 s in all (fit
10 min 51 s), peak RSS 2.7 GB, 388 MB added to the database (523,932 cached rows).

Runs in one process (rank 0 of a distributed build). The arguments are stored with the output; other arguments
are refused unless --overwrite. job.py writes (the passes and the job interface), cache.py reads (load_index,
attribution_rows: what the app and the benchmark use), __main__.py is the command line. What other code uses is
importable from the package itself (`from precompute import attribution as cache; cache.load_index(...)`).
"""
from precompute.attribution.cache import (
    BUILD_HINT,
    EXACT_ARRAYS,
    EXACT_ENTRY_ARRAYS,
    EXACT_FORMAT,
    GRADIENT_ARRAYS,
    GRADIENT_FORMAT,
    NAME,
    RERANK,
    SequenceCatalog,
    attribution_rows,
    document_text,
    exact_folder,
    gradient_folder,
    gradient_rows,
    has_attribution,
    index_folder_for,
    load_curvature,
    load_exact_store,
    load_factors,
    load_gradient_store,
    load_index,
    progress_file,
    read_progress,
    sequence_token_ids,
    sequences,
)
from precompute.attribution.job import (
    JOB,
    AttributionArgs,
    add_arguments,
    attribution_args,
    kept_tokens_folder,
    run,
    work_folder,
)

__all__ = ["BUILD_HINT", "EXACT_ARRAYS", "EXACT_ENTRY_ARRAYS", "EXACT_FORMAT", "GRADIENT_ARRAYS", "GRADIENT_FORMAT",
           "JOB", "NAME", "RERANK", "SequenceCatalog", "AttributionArgs", "add_arguments", "attribution_args",
           "attribution_rows", "document_text", "exact_folder", "gradient_folder", "gradient_rows", "has_attribution",
           "index_folder_for", "kept_tokens_folder", "load_curvature", "load_exact_store", "load_factors",
           "load_gradient_store", "load_index", "progress_file", "read_progress", "run", "sequence_token_ids",
           "sequences", "work_folder"]
