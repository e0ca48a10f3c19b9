"""LLM labelers: the card as one prompt, one JSON answer ({category, label, explanation}), one retry.

    labeler = OpenAICompatibleLabeler("http://127.0.0.1:8000/v1", "qwen")   # any OpenAI-style /chat/completions
    labeler = LocalInstructLabeler("path/to/instruct-model")                # transformers, local files only
    result = labeler.label(card)

Neither downloads anything: the endpoint is the user's server, the local model a folder on disk.
"""

from __future__ import annotations

import json
import logging
import re
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from precompute.labels.cards import PrototypeCard
from precompute.labels.labeler import MAX_LABEL_CHARS, LabelerError, LabelResult, normalize_category
from precompute.schema import CATEGORIES

logger = logging.getLogger("precompute.labels")

SYSTEM_PROMPT = ("You label the prototypes of an interpretable language model. Answer with one JSON object and "
                 "nothing else.")


def build_prompt(card: PrototypeCard, n_evidence: int = 12) -> str:
    """The card as text for an instruct model, ending with the JSON it must answer."""
    lines = [
        "A prototype is a learned direction in the model's final hidden state. It activates on the tokens marked "
        "«like this» in the contexts below (highest activation first). Name its role.",
        "",
        f"Prototype {card.prototype_id}: active on {card.activation_count} tokens"
        + (f", mean activation {card.mean_activation:.3f}" if card.mean_activation is not None else "")
        + (f", max {card.max_activation:.3f}" if card.max_activation is not None else ""),
    ]
    if card.activating_tokens:
        lines.append("Activating tokens: " + ", ".join(f"{t!r} x{n}" for t, n in card.activating_tokens[:12]))
    lines.append("Evidence:")
    for i, e in enumerate(card.evidence[:n_evidence], 1):
        lines.append(f"{i}. (a={e.activation:.2f}) {e.marked()}")
    if not card.evidence:
        lines.append("(none: the prototype was never active)")
    if card.next_tokens:
        lines.append("Tokens that follow the evidence: " + ", ".join(f"{t!r} x{n}" for t, n in card.next_tokens[:10]))
    if card.logit_tokens:
        lines.append("Tokens it promotes (logit signature): "
                     + ", ".join(f"{t!r}" for t, _ in card.logit_tokens[:10]))
    lines += [
        "",
        "Categories (choose exactly one): " + ", ".join(CATEGORIES) + ".",
        "Answer with JSON only: {\"category\": \"<one of the categories>\", \"label\": \"<a few words naming the "
        "specific role, e.g. 'year numbers', 'suffix -tion', 'archaic 2nd-person pronoun'>\", "
        "\"explanation\": \"<one sentence>\"}",
    ]
    return "\n".join(lines)


def parse_reply(text: str) -> LabelResult:
    """A labeler's reply -> LabelResult. Tolerates code fences and text around the JSON object; an unknown
    category becomes 'misc' with a note. Raises ValueError when no usable object is found."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "label" in obj and "category" in obj:
            break
    else:
        raise ValueError(f"no JSON object with 'category' and 'label' in the reply: {text[:200]!r}")
    label = " ".join(str(obj["label"]).split())[:MAX_LABEL_CHARS]
    if not label:
        raise ValueError(f"empty label in the reply: {text[:200]!r}")
    explanation = " ".join(str(obj.get("explanation") or "").split())
    category = normalize_category(str(obj["category"]))
    if category is None:
        explanation = f"(labeler said category {str(obj['category'])[:40]!r}, not in the taxonomy) {explanation}"
        category = "misc"
    return LabelResult(category, label, explanation.strip())


class _PromptLabeler:
    """Prompt -> completion -> parsed label, retrying once on a failed request or an unusable reply."""

    name = "prompt"

    def _complete(self, prompt: str) -> str:
        raise NotImplementedError

    def label(self, card: PrototypeCard) -> LabelResult:
        prompt = build_prompt(card)
        error: Exception | None = None
        for attempt in range(2):
            try:
                return parse_reply(self._complete(prompt))
            except (LabelerError, ValueError) as err:
                error = err
                logger.warning("%s, prototype %d, attempt %d: %s", self.name, card.prototype_id, attempt + 1, err)
        raise LabelerError(f"{self.name} failed twice on prototype {card.prototype_id}: {error}") from error


class OpenAICompatibleLabeler(_PromptLabeler):
    """POSTs the card to {base_url}/chat/completions (OpenAI chat format) with the standard library.

    base_url is the API root, e.g. http://127.0.0.1:8000/v1. The api_key, if any, is sent as a bearer token and is
    never stored in the database.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 60.0,
                 max_tokens: int = 300) -> None:
        parsed = urllib.parse.urlparse(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"endpoint must be an http(s) URL such as http://127.0.0.1:8000/v1, got {base_url!r}")
        self.base_url, self.model_id, self.timeout, self.max_tokens = base_url.rstrip("/"), model, timeout, max_tokens
        self._api_key = api_key
        self.name = f"openai:{model}@{self.base_url}"
        local = parsed.hostname in ("127.0.0.1", "localhost", "::1")
        handlers = [urllib.request.ProxyHandler({})] if local else []  # never send a local server through a proxy
        self._opener = urllib.request.build_opener(*handlers)

    def complete_with(self, system: str):
        """A function prompt -> reply text with another system prompt (bench/label_detection.py's LLM scorer)."""
        return lambda prompt: self._complete(prompt, system)

    def _complete(self, prompt: str, system: str = SYSTEM_PROMPT) -> str:
        url = f"{self.base_url}/chat/completions"
        body = {"model": self.model_id, "temperature": 0, "max_tokens": self.max_tokens,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": prompt}]}
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                payload = json.loads(response.read().decode("utf-8", errors="replace"))
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode("utf-8", errors="replace")
            raise LabelerError(f"{url} answered HTTP {err.code} {err.reason}: {detail}") from err
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            raise LabelerError(f"cannot reach {url}: {getattr(err, 'reason', err)}") from err
        except json.JSONDecodeError as err:
            raise LabelerError(f"{url} did not answer JSON: {err}") from err
        try:
            return str(payload["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError) as err:
            raise LabelerError(f"{url} answered no chat completion: {str(payload)[:200]}") from err


class LocalInstructLabeler(_PromptLabeler):
    """A transformers causal LM in a local folder (its chat template if it has one), greedy decoding.

    Loads with local_files_only=True: a path that is not a local model folder is an error, never a download.
    """

    def __init__(self, model_path: str | Path, max_new_tokens: int = 160, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a local transformers model folder (no config.json); "
                                    "LocalInstructLabeler never downloads")
        self.model_id, self.max_new_tokens, self.device = str(path), max_new_tokens, device
        self.name = f"local:{path.resolve().name}"
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(device).eval()

    def _complete(self, prompt: str) -> str:
        import torch

        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True, return_tensors="pt")
            ids = encoded["input_ids"]
        else:
            ids = self.tokenizer(f"{SYSTEM_PROMPT}\n\n{prompt}\nJSON:", return_tensors="pt").input_ids
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit and ids.shape[1] + self.max_new_tokens > limit:  # keep the end: it holds the answer format
            logger.warning("prompt of %d tokens cut to fit the model's %d positions", ids.shape[1], limit)
            ids = ids[:, -(limit - self.max_new_tokens):]
        ids = ids.to(self.device)  # (1, T)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens,
                                      do_sample=False, pad_token_id=pad)  # (1, T + new)
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
