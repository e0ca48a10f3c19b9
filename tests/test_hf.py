"""PRISM as a transformers model, driven by real clients: Auto classes, transformers' generate (every decoding mode
with interventions), streamers, stopping criteria, logits processors, pipeline and lm-eval's HFLM. Each result is
checked against an independent computation (a no-cache loop over the forward, a brute-force sampler, log-softmax
sums), on tiny local backbones; nothing is downloaded."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from helpers import random_ids, tiny_backbone_dir, tiny_prism
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    pipeline,
)

from prism import Interventions, PrismConfig, PrismForCausalLM
from prism.backbones import end_of_text_ids, load_backbone, load_tokenizer
from prism.controllers import PrototypeController


def _controller(n_prototypes: int, seed: int = 0) -> PrototypeController:
    g = torch.Generator().manual_seed(seed)
    return PrototypeController(torch.randn(n_prototypes, generator=g) * 2, {"task": "t", "seed": seed})


# Every intervention kind, with ids that exist in a bank of 16.
MODES = {
    "suppress-zero": lambda: Interventions(suppress={0, 1, 2, 3}),
    "suppress-reroute": lambda: Interventions(suppress={0, 1, 2, 3}, suppress_mode="reroute"),
    "scale": lambda: Interventions(scale={4: 3.0, 5: 0.0}),
    "inject": lambda: Interventions(inject={6: 2.0}),
    "controller": lambda: Interventions(controller=_controller(16)),
}


def _no_eos(model: PrismForCausalLM) -> PrismForCausalLM:
    """The references below never stop early; neither must generate."""
    model.generation_config.eos_token_id = None
    return model


@torch.no_grad()
def _reference_tokens(model, ids, n, interventions=None, sample=None):
    """n tokens from the forward alone, the whole sequence each step (no KV cache). sample=(temperature, top_k,
    seed) draws with a filter written here (keep the top_k logits) and a generator seeded with seed."""
    generator = torch.Generator().manual_seed(sample[2]) if sample else None
    seq = ids
    for _ in range(n):
        logits = model(seq, interventions=interventions).logits[:, -1].float()  # (B, V)
        if sample is None:
            nxt = logits.argmax(-1)
        else:
            temperature, top_k, _ = sample
            kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = (logits / temperature).masked_fill(logits < kth, -float("inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)
        seq = torch.cat([seq, nxt[:, None]], dim=1)
    return seq


# ----------------------------------------------------------------------------------------------------------------
# Auto classes and checkpoints.


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A full checkpoint of a tiny PRISM (Llama backbone) with its tokenizer beside it, and the model itself."""
    root = tmp_path_factory.mktemp("hf")
    backbone = tiny_backbone_dir(root / "backbone")
    model = PrismForCausalLM.from_backbone(load_backbone(str(backbone)),
                                           PrismConfig(n_prototypes=16, top_k=4, backbone=str(backbone)))
    torch.manual_seed(1)
    with torch.no_grad():
        model.prototypes.weight.normal_()
    model.eval().save_pretrained(root / "model")
    load_tokenizer(str(backbone)).save_pretrained(root / "model")
    return {"path": root / "model", "model": model, "backbone": backbone}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_auto_model_loads_a_full_checkpoint_with_equal_logits(kind, tmp_path):
    model = tiny_prism(kind)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "prism"
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, PrismConfig) and config.text_config.model_type == kind
    auto = AutoModelForCausalLM.from_pretrained(tmp_path)
    direct = PrismForCausalLM.from_pretrained(tmp_path)
    assert type(auto) is PrismForCausalLM
    ids = random_ids()
    with torch.no_grad():
        expected = model(ids).logits
        torch.testing.assert_close(auto(ids).logits, direct(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(auto(ids).logits, expected)
        torch.testing.assert_close(expected, model.backbone(ids).logits, rtol=1e-5, atol=1e-5)  # k-sparse, exact


def test_auto_model_loads_a_trainable_only_checkpoint_and_the_first_format(folder, tmp_path):
    model = folder["model"]
    model.requires_grad_(False)
    model.prototypes.requires_grad_(True)
    model.save_pretrained(tmp_path / "trainable", trainable_only=True)
    model.requires_grad_(True)
    ids = torch.randint(0, model.vocab_size, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
        auto = AutoModelForCausalLM.from_pretrained(tmp_path / "trainable")
        assert type(auto) is PrismForCausalLM and auto.config.weights == "trainable"
        torch.testing.assert_close(auto(ids).logits, expected)
        # a folder of the first PRISM format (no model_type) still loads through the class
        old = tmp_path / "old"
        old.mkdir()
        (old / "model.safetensors").write_bytes((tmp_path / "trainable" / "model.safetensors").read_bytes())
        config = json.loads((tmp_path / "trainable" / "config.json").read_text())
        prism = {k: config[k] for k in ("n_prototypes", "top_k", "lambda_rec", "lambda_r1", "lambda_r2", "backbone",
                                        "backbone_fingerprint", "metadata")}
        (old / "config.json").write_text(json.dumps({"format_version": 1, "weights": "trainable", "prism": prism,
                                                     "backbone_config": config["text_config"]}))
        torch.testing.assert_close(PrismForCausalLM.from_pretrained(old)(ids).logits, expected)


def test_hub_checkpoints_are_resolved_by_weight_kind(folder, tmp_path):
    """A hub id resolves through transformers' cached_file, which also reads local folders (no hub here): a
    trainable-only checkpoint is fetched file by file and loaded by PRISM, a full one is left to transformers."""
    from prism.model import _fetch_trainable

    model = folder["model"]
    model.requires_grad_(False)
    model.prototypes.requires_grad_(True)
    model.save_pretrained(tmp_path / "trainable", trainable_only=True)
    model.requires_grad_(True)
    assert _fetch_trainable(str(tmp_path / "trainable"), {}) == tmp_path / "trainable"
    assert _fetch_trainable(str(folder["path"]), {}) is None


def test_generation_config_stops_at_the_tokenizers_end_of_text_ids(folder, tmp_path):
    tokenizer = load_tokenizer(str(folder["path"]))
    eos = end_of_text_ids(tokenizer)
    assert eos == [tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    from prism.backbones import generation_config_for

    model = folder["model"]
    model.generation_config = generation_config_for(tokenizer, model.generation_config)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["eos_token_id"] == eos[0] and saved["pad_token_id"] == eos[0]
    assert AutoModelForCausalLM.from_pretrained(tmp_path).generation_config.eos_token_id == eos[0]


# ----------------------------------------------------------------------------------------------------------------
# transformers' generate with interventions.


@pytest.mark.parametrize("mode", list(MODES))
def test_generate_applies_interventions_at_every_step_greedy_and_sampled(mode):
    model = _no_eos(tiny_prism("llama"))
    ids = random_ids(batch=2, length=5, seed=4)
    iv = MODES[mode]()
    greedy = model.generate(ids, max_new_tokens=8, interventions=iv, do_sample=False)
    torch.testing.assert_close(greedy, _reference_tokens(model, ids, 8, iv))
    sampled = model.generate(ids, max_new_tokens=8, interventions=iv, do_sample=True, temperature=0.8, top_k=5,
                             seed=11)
    torch.testing.assert_close(sampled, _reference_tokens(model, ids, 8, iv, sample=(0.8, 5, 11)))
    # the same call through stream(): the app's loop draws the same tokens
    steps = list(model.stream(ids, 8, interventions=iv, do_sample=True, temperature=0.8, top_k=5, seed=11))
    torch.testing.assert_close(torch.stack([s.token_ids for s in steps], 1), sampled[:, ids.shape[1]:])


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_generate_equals_stream_tokens(kind):
    model = _no_eos(tiny_prism(kind))
    ids = random_ids(batch=1, length=6, seed=9)
    for iv in (None, MODES["suppress-reroute"](), MODES["controller"]()):
        steps = list(model.stream(ids, 10, interventions=iv))
        out = model.generate(ids, max_new_tokens=10, interventions=iv)
        assert [int(s.token_ids[0]) for s in steps] == out[0, ids.shape[1]:].tolist()


def test_interventions_change_generate_and_leave_nothing_behind():
    model = _no_eos(tiny_prism("llama"))
    ids = random_ids(batch=1, length=6, seed=2)
    plain = model.generate(ids, max_new_tokens=10)
    strong = model.generate(ids, max_new_tokens=10, interventions=Interventions(inject={5: 50.0}))
    assert not torch.equal(plain, strong)
    torch.testing.assert_close(model.generate(ids, max_new_tokens=10), plain)


def test_beam_search_scores_its_beams_with_the_intervened_logits():
    model = _no_eos(tiny_prism("gpt2"))
    ids = random_ids(batch=1, length=5, seed=3)
    iv = MODES["suppress-reroute"]()
    out = model.generate(ids, max_new_tokens=6, num_beams=3, length_penalty=0.0, do_sample=False,
                         interventions=iv, return_dict_in_generate=True, output_scores=True)
    seq = out.sequences[:1]  # (1, T + 6)
    with torch.no_grad():
        def score(interventions):  # the summed log-probability of the generated tokens, no cache
            logp = torch.log_softmax(model(seq[:, :-1], interventions=interventions).logits.float(), -1)
            new = seq[0, ids.shape[1]:]
            return float(logp[0, ids.shape[1] - 1:].gather(-1, new[:, None]).sum())

        assert float(out.sequences_scores[0]) == pytest.approx(score(iv), abs=1e-3)
        assert abs(score(None) - score(iv)) > 1e-3  # the score really is the intervened one


class _Record(LogitsProcessor):
    def __init__(self):
        self.scores = []

    def __call__(self, input_ids, scores):
        self.scores.append(scores.clone())
        return scores


class _StopAfter(StoppingCriteria):
    def __init__(self, token_id: int):
        self.token_id = token_id

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token_id


def test_streamer_stopping_criteria_and_logits_processors_see_the_interventions(folder):
    model, tokenizer = _no_eos(folder["model"]), load_tokenizer(str(folder["path"]))
    ids = tokenizer("the cat sat on the", return_tensors="pt").input_ids
    iv = Interventions(suppress={0, 1, 2}, scale={3: 2.0}, suppress_mode="reroute")
    free = model.generate(ids, max_new_tokens=8, interventions=iv)
    stop_token = int(free[0, ids.shape[1] + 2])  # stop at the third generated token
    first = free[0, ids.shape[1]:].tolist().index(stop_token)
    record = _Record()
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=model.generate(
        ids, max_new_tokens=8, interventions=iv, streamer=streamer, logits_processor=LogitsProcessorList([record]),
        stopping_criteria=StoppingCriteriaList([_StopAfter(stop_token)]))))
    thread.start()
    text = "".join(streamer)
    thread.join()
    out = result["out"]
    assert out[0, ids.shape[1]:].tolist() == free[0, ids.shape[1]:ids.shape[1] + first + 1].tolist()
    assert text == tokenizer.decode(out[0, ids.shape[1]:])
    with torch.no_grad():
        expected = model(out[:, :-1], interventions=iv).logits[0, ids.shape[1] - 1:]  # (n, V)
    torch.testing.assert_close(torch.cat(record.scores), expected.float(), rtol=1e-4, atol=1e-4)


def test_text_generation_pipeline_loads_the_folder_and_matches_generate(folder):
    generator = pipeline("text-generation", model=str(folder["path"]))
    assert type(generator.model) is PrismForCausalLM
    tokenizer = generator.tokenizer
    prompt = "one two three"
    text = generator(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    model = PrismForCausalLM.from_pretrained(folder["path"])
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert text == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------------------------
# lm-eval.

DOCS = [
    {"question": "the cat sat on the", "choices": ["red house", "blue tree", "green river"], "answer": 0},
    {"question": "one two three", "choices": ["four", "days ago"], "answer": 1},
    {"question": "the bird flew over", "choices": ["a small tree", "seven years"], "answer": 0},
    {"question": "in the river", "choices": ["and then", "it was", "near a"], "answer": 2},
]


def write_task(folder, docs=DOCS, name="prism_tiny_mc"):
    """A multiple-choice task over a local JSONL file: lm-eval's own YAML format, no hub."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{name}.yaml").write_text("\n".join([
        f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {json.dumps(str(data))}",
        "test_split: test", "output_type: multiple_choice", 'doc_to_text: "{{question}}"',
        'doc_to_choice: "{{choices}}"', 'doc_to_target: "{{answer}}"', "metric_list:", "  - metric: acc",
        "    aggregation: mean", "    higher_is_better: true", ""]))
    return folder


@torch.no_grad()
def reference_loglikelihoods(model, tokenizer, doc) -> list[float]:
    """log p(" " + choice | question), summed over the choice's tokens, split as lm-eval splits: the tokens of
    question + continuation past those of the question alone."""
    context = tokenizer(doc["question"]).input_ids
    result = []
    for choice in doc["choices"]:
        whole = tokenizer(doc["question"] + " " + choice).input_ids
        ids = torch.tensor([whole])
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)  # (T, V)
        result.append(sum(float(logp[t - 1, whole[t]]) for t in range(len(context), len(whole))))
    return result


def _check_lm_eval_results(results, model, tokenizer, docs=DOCS, name="prism_tiny_mc"):
    samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
    correct = []
    for sample, doc in zip(samples, docs, strict=True):
        scores = [float(ll) for ll, _ in sample["filtered_resps"]]
        assert scores == pytest.approx(reference_loglikelihoods(model, tokenizer, doc), rel=1e-4, abs=1e-4)
        correct.append(float(max(range(len(scores)), key=scores.__getitem__) == doc["answer"]))
    assert results["results"][name]["acc,none"] == pytest.approx(sum(correct) / len(correct))


@pytest.mark.slow
def test_lm_eval_hflm_scores_the_model_like_an_independent_computation(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tokenizer = folder["model"].eval(), load_tokenizer(str(folder["path"]))
    tasks = write_task(tmp_path / "tasks")
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=2)
    results = simple_evaluate(model=lm, tasks=["prism_tiny_mc"], task_manager=TaskManager(include_path=str(tasks)),
                              log_samples=True)
    _check_lm_eval_results(results, model, tokenizer)


@pytest.mark.slow
def test_lm_eval_command_loads_the_folder_through_prism_harness(folder, tmp_path, monkeypatch):
    """The README's command: `python -m prism.harness` is lm-eval's command line with prism registered."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from prism.harness import main

    tasks = write_task(tmp_path / "tasks")
    main(["--model", "hf", "--model_args", f"pretrained={folder['path']},backend=causal", "--tasks",
          "prism_tiny_mc", "--include_path", str(tasks), "--batch_size", "2", "--log_samples",
          "--output_path", str(tmp_path / "out")])
    files = sorted((tmp_path / "out").rglob("results_*.json"))
    assert files, "lm-eval wrote no results"
    acc = json.loads(files[-1].read_text())["results"]["prism_tiny_mc"]["acc,none"]
    samples = [json.loads(line) for f in (tmp_path / "out").rglob("samples_prism_tiny_mc_*.jsonl")
               for line in f.read_text().splitlines()]
    _check_lm_eval_results({"results": {"prism_tiny_mc": {"acc,none": acc}}, "samples": {"prism_tiny_mc": samples}},
                           folder["model"].eval(), load_tokenizer(str(folder["path"])))


# ----------------------------------------------------------------------------------------------------------------
# The shipped default (assets/model, trainable-only over SmolLM2-135M): what the "done when" names.


@pytest.fixture(scope="module")
def shipped():
    from app.assets import DEFAULT_MODEL

    auto = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL)
    return {"path": DEFAULT_MODEL, "model": auto, "tokenizer": load_tokenizer(str(DEFAULT_MODEL))}


def test_shipped_model_loads_through_auto_classes_like_the_class(shipped):
    auto, tokenizer = shipped["model"], shipped["tokenizer"]
    assert type(auto) is PrismForCausalLM and auto.config.weights == "trainable"
    direct = PrismForCausalLM.from_pretrained(shipped["path"])
    ids = tokenizer("The river flows into the", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(auto(ids).logits, direct(ids).logits, rtol=0, atol=0)
    eos = auto.generation_config.eos_token_id
    assert eos == end_of_text_ids(tokenizer) and set(eos) == {tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                                               tokenizer.convert_tokens_to_ids("<|endoftext|>")}


def test_shipped_model_samples_with_top_k_a_streamer_and_a_stop_under_interventions(shipped):
    model, tokenizer = shipped["model"], shipped["tokenizer"]
    ids = tokenizer("In the beginning God created", return_tensors="pt").input_ids
    with torch.no_grad():
        plain = model(ids)
    iv = Interventions(suppress=set(plain.prototype_ids[0, -1, :3].tolist()), suppress_mode="reroute")
    settings = dict(do_sample=True, temperature=0.9, top_k=20, seed=5)
    steps = list(model.stream(ids, 6, interventions=iv, **settings))
    expected = [int(s.token_ids[0]) for s in steps]
    stop_token = expected[3]
    expected = expected[:expected.index(stop_token) + 1]
    record = _Record()
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=model.generate(
        ids, max_new_tokens=6, interventions=iv, streamer=streamer, logits_processor=LogitsProcessorList([record]),
        stopping_criteria=StoppingCriteriaList([_StopAfter(stop_token)]), **settings)))
    thread.start()
    text = "".join(streamer)
    thread.join()
    generated = result["out"][0, ids.shape[1]:].tolist()
    assert generated[:len(expected)] == expected
    assert len(generated) == len(expected) or set(generated[len(expected):]) <= set(end_of_text_ids(tokenizer))
    assert text == tokenizer.decode(result["out"][0, ids.shape[1]:])
    with torch.no_grad():
        intervened = model(ids, interventions=iv).logits[0, -1]
    torch.testing.assert_close(record.scores[0][0], intervened.float(), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(intervened, plain.logits[0, -1], atol=1e-3)  # the suppression moved the logits


@pytest.mark.slow
def test_lm_eval_scores_the_shipped_model(shipped, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    docs = [{"question": "The capital of France is", "choices": ["Paris", "a banana", "seven"], "answer": 0},
            {"question": "One, two, three,", "choices": ["purple", "four"], "answer": 1},
            {"question": "The sun rises in the", "choices": ["east", "spoon"], "answer": 0}]
    model, tokenizer = shipped["model"], shipped["tokenizer"]
    tasks = write_task(tmp_path / "tasks", docs)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4)
    results = simple_evaluate(model=lm, tasks=["prism_tiny_mc"], task_manager=TaskManager(include_path=str(tasks)),
                              log_samples=True)
    _check_lm_eval_results(results, model, tokenizer, docs)
