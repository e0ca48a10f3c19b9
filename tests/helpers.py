"""Tiny random backbones and models shared by the tests (CPU, seconds)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from prism import PrismConfig, PrismForCausalLM

VOCAB = 97


def tiny_llama(seed: int = 0, n_layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def tiny_gpt2(seed: int = 0, n_layers: int = 3) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=n_layers, n_head=4, n_positions=128,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


BACKBONES = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def tiny_prism(kind: str = "llama", n_prototypes: int = 16, top_k: int = 4, seed: int = 0) -> PrismForCausalLM:
    model = PrismForCausalLM.from_backbone(BACKBONES[kind](seed), PrismConfig(n_prototypes=n_prototypes, top_k=top_k))
    torch.manual_seed(seed + 1)
    with torch.no_grad():  # prototypes near real directions so several are active per token
        model.prototypes.weight.normal_()
    return model.eval()


def random_ids(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


WORDS = ("the cat dog bird sat ran flew over under near a red blue green small big house tree river "
         "and then it was one two three four five seven days years ago in on").split()


def synthetic_documents(n_docs: int = 60, seed: int = 0) -> list[dict]:
    """Deterministic made-up documents (no third-party text): a few registers so prototypes have structure."""
    rng = random.Random(seed)
    docs = []
    for i in range(n_docs):
        if i % 3 == 0:
            text = " ".join(f"{rng.randint(1, 99)} {rng.choice(['days', 'years', 'ago'])}." for _ in range(30))
        else:
            text = " ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) + "." for _ in range(12))
        docs.append({"id": f"doc-{i}", "text": text})
    return docs


def write_corpus(folder: Path, n_docs: int = 60, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in synthetic_documents(n_docs, seed)))
    return path


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the synthetic documents: offline, deterministic, about 300 tokens."""
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([d["text"] for d in synthetic_documents()], vocab_size=300, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>")


def tiny_backbone_dir(folder: Path, kind: str = "llama", seed: int = 0) -> Path:
    """A saved tiny backbone plus tokenizer, usable as --backbone by the command-line tools."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    vocab = len(tokenizer)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                          bos_token_id=tokenizer.eos_token_id)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=3, n_head=4, n_positions=256, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id)
        model = GPT2LMHeadModel(cfg)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def saved_random_prism(root: Path, n_prototypes: int, top_k: int, seed: int = 0) -> str:
    """A PRISM model over a tiny backbone with Gaussian prototypes, saved with its tokenizer in root/model (the
    precompute jobs' --model); returns the folder."""
    from prism.backbones import load_backbone, load_tokenizer

    backbone_dir = tiny_backbone_dir(root / "bb")
    model = PrismForCausalLM.from_backbone(load_backbone(str(backbone_dir)),
                                           PrismConfig(n_prototypes=n_prototypes, top_k=top_k))
    torch.manual_seed(seed)
    with torch.no_grad():
        model.prototypes.weight.normal_()
    model.save_pretrained(root / "model")
    load_tokenizer(str(backbone_dir)).save_pretrained(root / "model")
    return str(root / "model")


def kill_then_resume(argv: list[str], work: Path, after_chunk: int = 3) -> None:
    """`python -m precompute` with argv, SIGKILLed after chunk `after_chunk` (the kill-after-chunk hook), then the
    same command again in this process: the first must die with chunks checkpointed in `work` (the job's work
    folder), the second resume and finish, leaving no work folder."""
    import os
    import subprocess
    import sys

    from precompute.__main__ import main as precompute_main

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-m", "precompute", *argv, "--hook", f"kill-after-chunk={after_chunk}"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (work / "rank0").exists()  # the chunks before the kill were checkpointed
    precompute_main(argv)
    assert not work.exists()
