"""The EK-FAC peer of prototype-space attribution (docs/DESIGN.md section 4, level 3): kronfluence over the trainable
linear layers of a PRISM model, with the same loss, training sequences and queries as prism/attribution.py.

The model kronfluence sees is TopLayers: it takes the hidden states entering the first trainable decoder layer
(computed once by the frozen layers below, as top-N training caches them) and runs the trainable top layers, the
final norm and the LM head. So the peer pays for every trainable layer's forward and backward on every training
sequence, and nothing for frozen layers that no gradient reaches.

Loss: the summed next-token cross-entropy of the model's logits (equal in value to the prototype route's logits);
with sample=True, labels drawn from the model's own distribution (the true Fisher, kronfluence's default).
Measurement: the cross-entropy of the query token at its position. Scores: kronfluence's pairwise scores,
g_q^T H^-1 g_s, positive = helpful, as in prism/attribution.py.

    from bench.attribution_ekfac import EkfacPeer
    peer = EkfacPeer(model, start_layer, output_dir)          # wraps model's linear layers in place
    peer.fit(train_dataset, batch_size=8)                     # covariance, eigendecomposition, lambda
    scores = peer.scores(query_dataset, train_dataset, ...)   # (Q, N)

Needs a backbone whose trainable layers are nn.Linear (Llama, Qwen, SmolLM2, ...): kronfluence does not track
GPT-2's Conv1D. It lives beside its benchmark (bench/attribution.py) because kronfluence is a benchmark dependency
(installed with --no-deps, requirements-nodeps.txt), never one of the library's: tests/test_imports.py checks that
nothing outside bench/ imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from kronfluence.analyzer import Analyzer, prepare_model
from kronfluence.arguments import FactorArguments, ScoreArguments
from kronfluence.task import Task
from torch.utils.data import Dataset

from prism.losses import IGNORE_INDEX
from prism.model import PrismForCausalLM

logger = logging.getLogger(__name__)

FACTORS_NAME = "prism_ekfac"
SCORES_NAME = "prism_pairwise"


class TopLayers(nn.Module):
    """(input_ids, start_states, attention_mask) -> logits (B, T, V) through decoder layers start_layer.. only."""

    def __init__(self, model: PrismForCausalLM, start_layer: int) -> None:
        super().__init__()
        if not 0 <= start_layer < model.n_layers:
            raise ValueError(f"start_layer must be in [0, {model.n_layers}), got {start_layer}")
        self.model = model
        self.start_layer = start_layer

    def forward(self, input_ids: torch.Tensor, start_states: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        z, _ = self.model.final_states(input_ids, attention_mask=attention_mask, start_layer=self.start_layer,
                                       start_states=start_states)
        return self.model.lm_head(z)

    def tracked_module_names(self) -> list[str]:
        """Names (in this module) of the nn.Linear layers inside the decoder layers that run here."""
        layers = list(self.model.decoder_layers())[self.start_layer:]
        inside = {id(m) for layer in layers for m in layer.modules()}
        names = [name for name, m in self.named_modules() if isinstance(m, nn.Linear) and id(m) in inside]
        if not names:
            raise ValueError("the trainable decoder layers hold no nn.Linear modules (kronfluence tracks nn.Linear "
                             "and nn.Conv2d only; GPT-2's Conv1D is not supported)")
        return names


class SequenceDataset(Dataset):
    """Padded items for kronfluence: input_ids, start_states, attention_mask and labels (IGNORE_INDEX where there is
    no target; labels follow the transformers convention and are shifted in the loss).

    ids: one (L_i,) token array per item; states(i) -> (L_i, d) the states entering start_layer; target_positions:
    per item the positions whose next-token loss counts (None: every position)."""

    def __init__(self, ids: list, states: Callable[[int], torch.Tensor], length: int,
                 target_positions: list | None = None) -> None:
        self.ids, self.states, self.length = ids, states, length
        self.target_positions = target_positions

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.as_tensor(self.ids[i], dtype=torch.long)[: self.length]
        n = len(ids)
        states = torch.as_tensor(self.states(i), dtype=torch.float32)[:n]
        input_ids = torch.zeros(self.length, dtype=torch.long)
        input_ids[:n] = ids
        padded = torch.zeros(self.length, states.shape[-1])
        padded[:n] = states
        mask = torch.zeros(self.length, dtype=torch.long)
        mask[:n] = 1
        labels = torch.full((self.length,), IGNORE_INDEX, dtype=torch.long)
        if self.target_positions is None:
            labels[:n] = ids
        else:
            for t in self.target_positions[i]:  # position t predicts token t + 1
                labels[t + 1] = ids[t + 1]
        return {"input_ids": input_ids, "start_states": padded, "attention_mask": mask, "labels": labels}


def _shifted(batch: dict[str, torch.Tensor], model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["input_ids"], batch["start_states"], batch["attention_mask"]).float()  # (B, T, V)
    logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    labels = batch["labels"][:, 1:].reshape(-1)
    return logits, labels


class PrismLanguageModelingTask(Task):
    """The loss of prism/attribution.py for kronfluence: summed next-token cross-entropy; the query token's
    cross-entropy as the measurement."""

    def __init__(self, tracked: list[str]) -> None:
        self.tracked = tracked

    def compute_train_loss(self, batch, model: nn.Module, sample: bool = False) -> torch.Tensor:
        logits, labels = _shifted(batch, model)
        if sample:
            with torch.no_grad():
                drawn = torch.multinomial(logits.softmax(-1), 1).squeeze(-1)
            labels = torch.where(labels == IGNORE_INDEX, labels, drawn)
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def compute_measurement(self, batch, model: nn.Module) -> torch.Tensor:
        logits, labels = _shifted(batch, model)
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def get_influence_tracked_modules(self) -> list[str]:
        return self.tracked

    def get_attention_mask(self, batch) -> torch.Tensor:
        return batch["attention_mask"]


class EkfacPeer:
    """kronfluence's Analyzer on TopLayers. Wraps the model's linear layers IN PLACE (use a model loaded for this)."""

    def __init__(self, model: PrismForCausalLM, start_layer: int, output_dir: str | Path,
                 damping: float | None = None) -> None:
        self.top = TopLayers(model.eval(), start_layer)
        self.task = PrismLanguageModelingTask(self.top.tracked_module_names())
        self.damping = damping  # None: kronfluence's heuristic, 0.1 x mean eigenvalue
        prepared = prepare_model(self.top, self.task)
        self.analyzer = Analyzer(analysis_name="prism", model=prepared, task=self.task, cpu=True,
                                 output_dir=str(output_dir), disable_tqdm=True,
                                 log_level=logging.WARNING)

    @property
    def n_tracked(self) -> int:
        return len(self.task.tracked)

    def fit(self, train: Dataset, batch_size: int = 8, max_examples: int | None = None) -> None:
        """EK-FAC factors over the training sequences: covariances, eigendecomposition, eigenvalue correction; with
        max_examples, both passes read only the first that many sequences (kronfluence's covariance_max_examples
        and lambda_max_examples; the scores still cover every sequence)."""
        limit = {} if max_examples is None else {"covariance_max_examples": max_examples,
                                                  "lambda_max_examples": max_examples}
        self.analyzer.fit_all_factors(factors_name=FACTORS_NAME, dataset=train, per_device_batch_size=batch_size,
                                      factor_args=FactorArguments(strategy="ekfac", **limit),
                                      overwrite_output_dir=True)

    def scores(self, queries: Dataset, train: Dataset, query_batch: int = 8, train_batch: int = 8) -> torch.Tensor:
        """Pairwise influence scores (Q, N) of every query on every training sequence."""
        args = ScoreArguments(damping_factor=self.damping)
        self.analyzer.compute_pairwise_scores(scores_name=SCORES_NAME, factors_name=FACTORS_NAME,
                                              query_dataset=queries, train_dataset=train,
                                              per_device_query_batch_size=query_batch,
                                              per_device_train_batch_size=train_batch, score_args=args,
                                              overwrite_output_dir=True)
        return self.analyzer.load_pairwise_scores(SCORES_NAME)["all_modules"]
