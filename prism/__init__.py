"""PRISM: prototype language models with exact, native attribution of every logit (arXiv 2607.00510).

    from prism import PrismConfig, PrismForCausalLM, Interventions
"""

from prism.config import PrismConfig
from prism.model import (
    ActivationController,
    Decomposition,
    GenerationStep,
    Interventions,
    PrismForCausalLM,
    PrismOutput,
)

__all__ = ["ActivationController", "Decomposition", "GenerationStep", "Interventions", "PrismConfig",
           "PrismForCausalLM", "PrismOutput"]
