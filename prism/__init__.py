"""PRISM: prototype language models with exact, native attribution of every logit (arXiv 2607.00510).

    from prism import PrismConfig, PrismForCausalLM, Interventions

Importing prism registers model_type "prism" with transformers' Auto classes, so
AutoModelForCausalLM.from_pretrained(folder) and pipeline("text-generation", model=folder) load a PRISM folder.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from prism.config import PrismConfig
from prism.model import (
    ActivationController,
    Decomposition,
    GenerationStep,
    Interventions,
    PrismForCausalLM,
    PrismOutput,
)

AutoConfig.register(PrismConfig.model_type, PrismConfig, exist_ok=True)
AutoModel.register(PrismConfig, PrismForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(PrismConfig, PrismForCausalLM, exist_ok=True)

__all__ = ["ActivationController", "Decomposition", "GenerationStep", "Interventions", "PrismConfig",
           "PrismForCausalLM", "PrismOutput"]
