"""The corpus command, `python -m precompute.corpus fetch | export | stats` (__main__.py). The corpora themselves
(the offline defaults, local files, hub datasets, the npm sources) are library code in prism/corpora, so training
reads a named corpus (`python -m prism.train --corpus default-v3`) without going through the jobs; this package
re-exports them for older imports."""

from prism.corpora import *  # noqa: F403
from prism.corpora import __all__  # noqa: F401
