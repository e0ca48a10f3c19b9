"""The app's tools for agents and scripts: stateless endpoints (gr.api) that take everything they need as arguments
and answer JSON, so an MCP client (`python app.py --mcp`: Gradio serves them at /gradio_api/mcp/) or gradio_client
can ask what the page shows: a generation with its prototypes, one token's exact decomposition, a search, a card,
what an intervention changes and the training data behind a token.

    register(studio)        # inside the app's gr.Blocks: one endpoint per tool, named after the function
    TOOLS                   # their names; the page's own events are kept out of the MCP tool list (ui.launch)

Every number comes from the same Studio calls the page makes (app/core.py), so a tool's answer equals the page's
and the library's. Interventions are given per call (suppress: prototype ids; scale: {id: factor}); suppression
re-routes, as the page does by default. Each explanation says how much the prototypes carry and how much the
residual does, never only the sum.
"""

from __future__ import annotations

import math

import gradio as gr

from app import interventions, limits
from app.attribution import attribute_token, check_reading
from app.core import GenerationSettings, Studio
from app.errors import AppError
from app.generation import Generation
from app.messages import guarded
from app.session import Session
from prism.explain import contrast_tokens

TOOLS = ("generate_explained", "explain_token", "search_prototypes", "prototype_card", "compare_interventions",
         "training_data")
N_SLICES = 12  # slices listed per token (the rest are summed into one number, so the parts still add up)


def _settings(studio: Studio, prompt, max_new_tokens, temperature, seed) -> GenerationSettings:
    return studio.check_settings(GenerationSettings(prompt, max_new_tokens, temperature, 1.0, seed))


def _admit(studio: Studio, request: gr.Request | None, settings: GenerationSettings, columns: int) -> None:
    """Admission by cost, as for the page's Generate (limits.CostBudget, per session hash). Gradio's MCP server
    calls the tools through one client of its own, so all MCP callers share one budget."""
    session_hash = getattr(request, "session_hash", None)
    if not session_hash:
        return
    ids, max_new, _ = studio.encode_prompt(settings)
    cost = limits.generation_cost(len(ids), max_new, columns)
    wait = studio.budget.spend(session_hash, cost)
    if wait > 0:
        raise AppError(f"this caller has used its share of the model for now: wait {math.ceil(wait)} s (this call "
                       f"costs {cost:.0f} units of {studio.limits.cost_burst:.0f})")


def _session(studio: Studio, suppress, scale, inject=None) -> Session:
    """The interventions of one call as a page session would hold them (the same checks and limits)."""
    if suppress is not None and not isinstance(suppress, list):
        raise AppError("suppress must be a list of prototype ids")
    for name, value, what in (("scale", scale, "factor"), ("inject", inject, "activation")):
        if value is not None and not isinstance(value, dict):
            raise AppError(f"{name} must be an object {{prototype id: {what}}}")
    suppress, scale, inject = suppress or [], scale or {}, inject or {}
    if len(suppress) + len(scale) + len(inject) > studio.limits.max_interventions:
        raise AppError(f"at most {studio.limits.max_interventions} interventions in one call")
    session = Session()
    items = [interventions.suppressed(studio, p) for p in suppress]
    items += [interventions.scaled(studio, p, f) for p, f in scale.items()]
    items += [interventions.injected(studio, p, a) for p, a in inject.items()]
    for item in items:  # the page's own checks (app/interventions.py)
        session = session.add(item)
    return session


def _tokens(studio: Studio, gen: Generation, top: int = 3) -> list[dict]:
    return [{"index": i, "token": s.text, "token_id": s.token_id,
             "prototypes": [{"id": p, "label": studio.label(p)[0], "activation": round(a, 4)}
                            for p, a in zip(s.prototype_ids[:top], s.activations[:top], strict=False)]}
            for i, s in enumerate(gen.steps)]


def _run(studio: Studio, gen: Generation) -> dict:
    return {"text": gen.text, "tokens": _tokens(studio, gen), "notes": list(gen.notes)}


def _decomposition(d) -> dict:
    """A token's logit = residual + one slice per active prototype: the largest N_SLICES slices by size, the rest
    as one number, and the shares of |logit| parts."""
    slices = sorted(d.slices, key=lambda s: -abs(s.contribution))
    shown, rest = slices[:N_SLICES], slices[N_SLICES:]
    carried = sum(s.contribution for s in d.slices)
    size = abs(d.residual) + sum(abs(s.contribution) for s in d.slices)
    return {"token": d.token, "token_id": d.token_id, "logit": d.logit, "probability": d.probability,
            "residual": d.residual, "prototypes_total": carried, "sum": d.total,
            "residual_share_of_parts": abs(d.residual) / size if size else None,
            "slices": [{"id": s.prototype_id, "label": s.label, "category": s.category, "activation": s.activation,
                        "contribution": s.contribution} for s in shown],
            "other_slices": {"count": len(rest), "contribution": sum(s.contribution for s in rest)}}


def _contrast(studio: Studio, c, note: str) -> dict:
    """Why the written token and not the other: margin = residual + one part per prototype, exactly (the largest
    N_SLICES parts listed, the rest summed)."""
    parts = sorted(zip(c.prototype_ids, c.contributions, strict=True), key=lambda p: -abs(p[1]))
    shown, rest = parts[:N_SLICES], parts[N_SLICES:]
    return {"against": studio.decode(c.token_b), "against_id": c.token_b, "margin": c.margin,
            "residual": c.residual, "prototypes": c.prototypes, "note": note or None,
            "parts": [{"id": p, "label": studio.label(p)[0], "contribution": v} for p, v in shown],
            "other_parts": {"count": len(rest), "contribution": sum(v for _, v in rest)}}


def register(studio: Studio, model: dict | None = None) -> None:
    """One gr.api endpoint per tool, inside the app's Blocks (call it within `with gr.Blocks()`); `model`: the
    concurrency settings of the page's model events, which the tools that run the model share."""

    @guarded
    def generate_explained(prompt: str, max_new_tokens: int = 24, suppress: list | None = None,
                           scale: dict | None = None, temperature: float = 0.0, seed: int = 0,
                           inject: dict | None = None, request: gr.Request = None) -> dict:
        """Continue a prompt with the PRISM model and list, for every generated token, the prototypes that
        produced it (id, label, activation). With interventions, the intervened continuation as well, and the
        indices where it differs from the original.

        Args:
            prompt: the text to continue.
            max_new_tokens: how many tokens to write (the app's limit applies).
            suppress: prototype ids to switch off (re-routed to the nearest other prototypes, as the app does).
            scale: {prototype id: factor} to multiply an activation by (0 to 5).
            temperature: 0 for greedy decoding; above 0 samples with this seed.
            seed: the sampling seed.
            inject: {prototype id: activation} to switch a prototype on at every token (steering; 0 to 50).
        """
        settings = _settings(studio, prompt, max_new_tokens, temperature, seed)
        session = _session(studio, suppress, scale, inject)
        _admit(studio, request, settings, 1 + bool(session.items))
        original = studio.generate(settings)
        out = {"original": _run(studio, original), "intervened": None, "changed": []}
        if session.items:
            intervened = studio.generate(settings, session.interventions())
            out["intervened"] = _run(studio, intervened)
            a, b = original.token_ids, intervened.token_ids
            out["changed"] = [i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]]
        return out

    @guarded
    def explain_token(prompt: str, index: int, max_new_tokens: int = 24, suppress: list | None = None,
                      scale: dict | None = None, temperature: float = 0.0, seed: int = 0,
                      alternatives: int = 5, versus: str | None = None, request: gr.Request = None) -> dict:
        """Why the model wrote generated token `index`: its logit split exactly into the residual (what the
        prototypes do not explain, the LM head's bias included) and one slice per active prototype, the same split
        for the top alternative tokens, the share of the margin over the runner-up that the prototypes carry, and
        that margin split exactly into the residual's part and one part per prototype (the contrast; against
        `versus` when given).

        Args:
            prompt: the text to continue (the same settings give the same text as generate_explained).
            index: which generated token (0 is the first).
            max_new_tokens: as in generate_explained.
            suppress: prototype ids to switch off; the intervened text's token is explained.
            scale: {prototype id: factor}.
            temperature: 0 for greedy.
            seed: the sampling seed.
            alternatives: how many top tokens at that position to decompose (1 to 10).
            versus: a token (text) to contrast the written one with instead of the runner-up, e.g. ' the'.
        """
        settings = _settings(studio, prompt, max_new_tokens, temperature, seed)
        session = _session(studio, suppress, scale)
        n_alt = limits.whole("alternatives", alternatives, 1, 10)
        _admit(studio, request, settings, 1)
        gen = studio.generate(settings, session.interventions() if session.items else None)
        view = studio.explain(gen, index, n_alternatives=max(n_alt, 2))
        if versus is None:  # the runner-up by its id (its text may not encode back to the same token)
            runner = next(a for a in view.alternatives if a.token_id != view.chosen.token_id)
            contrast, note = contrast_tokens(studio.model, studio.state(gen, view.index), view.chosen.token_id,
                                             runner.token_id, gen.interventions), ""
        else:
            contrast, note = studio.contrast(gen, view.index, limits.text("versus", versus, 200))
        return {"index": view.index, "position": view.position, "text": gen.text,
                "chosen": _decomposition(view.chosen),
                "alternatives": [_decomposition(a) for a in view.alternatives[:n_alt]],
                "carried": view.carried.as_dict() if view.carried else None,
                "contrast": _contrast(studio, contrast, note)}

    @guarded
    def search_prototypes(query: str, mode: str = "semantic", k: int = 10) -> list:
        """Find prototypes by what their labels, topics and predictions say (mode 'semantic', by meaning) or by a
        substring of the label (mode 'label'). Returns [{prototype_id, label, category, score}] best first.

        Args:
            query: words to look for, e.g. 'money' or 'line breaks in code'.
            mode: 'semantic' or 'label'.
            k: how many to return (1 to 100).
        """
        return studio.need_db().search(limits.text("the search", query, 200), mode, limits.whole("k", k, 1, 100))

    @guarded
    def prototype_card(prototype_id: int, n_evidence: int = 5) -> dict:
        """One prototype: its label (where it fires, what it pushes the next token toward, its topic), category,
        label scores, the tokens its logit signature raises and lowers most, and its strongest evidence in the
        training corpus (document, token, activation and the text around it).

        Args:
            prototype_id: the prototype's id.
            n_evidence: how many evidence contexts (0 to 20).
        """
        pid = studio.check_prototype(prototype_id)
        card = studio.need_db().card(pid, n_evidence=limits.whole("n_evidence", n_evidence, 0, 20))
        raises, lowers = studio.signature_ends(pid)
        keep = ("prototype_id", "label", "category", "topic", "fires_on", "pushes", "label_score",
                "sibling_score", "detection_random", "detection_sibling", "activation_count", "mean_activation",
                "max_activation")
        out = {k: getattr(card, k) for k in keep}
        out["raises"], out["lowers"] = raises, lowers
        out["evidence"] = [{"doc_id": e["doc_id"], "source": e.get("source"), "token": e["token"],
                            "activation": e["activation"],
                            "context": "".join(s["text"] for s in e.get("segments", []))}
                           for e in card.evidence]
        return out

    @guarded
    def compare_interventions(prompt: str, suppress: list | None = None, scale: dict | None = None,
                              max_new_tokens: int = 24, temperature: float = 0.0, seed: int = 0,
                              inject: dict | None = None, request: gr.Request = None) -> dict:
        """Switch prototypes off (suppress), up and down (scale) or on everywhere (inject: steering), generate with
        and without, and say where the text first changed and why: the intervened prototypes' effects on the new
        token against the one the original would have written there, which add up exactly to that change of
        margin.

        Args:
            prompt: the text to continue.
            suppress: prototype ids to switch off (re-routed, as the app does).
            scale: {prototype id: factor} (0 to 5).
            max_new_tokens: how many tokens to write.
            temperature: 0 for greedy.
            seed: the sampling seed.
            inject: {prototype id: activation} to switch a prototype on at every token (0 to 50).
        """
        settings = _settings(studio, prompt, max_new_tokens, temperature, seed)
        session = _session(studio, suppress, scale, inject)
        if not session.items:
            raise AppError("give at least one prototype to suppress, scale or inject")
        _admit(studio, request, settings, 2)
        original = studio.generate(settings)
        intervened = studio.generate(settings, session.interventions())
        a, b = original.token_ids, intervened.token_ids
        first = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
        why = studio.why_changed(original, intervened, first).as_dict() if first is not None else None
        return {"original": original.text, "intervened": intervened.text, "first_change": first, "why": why,
                "interventions": session.rows()}

    @guarded
    def training_data(prompt: str, index: int, max_new_tokens: int = 24, temperature: float = 0.0, seed: int = 0,
                      top: int = 10, reading: str = "gradient", request: gr.Request = None) -> dict:
        """The training sequences that most lowered the loss of generated token `index` (influence through the
        trained layers' gradients, or through the token's active prototypes): document ids, spans and scores,
        best first; "reading" in the result is the reading used and "note" says why it differs from the one asked.

        Args:
            prompt: the text to continue (the original text, without interventions).
            index: which generated token (0 is the first).
            max_new_tokens: as in generate_explained.
            temperature: 0 for greedy.
            seed: the sampling seed.
            top: how many sequences (1 to 50).
            reading: "gradient" (the positions where a sequence predicted this same token, read in the trained
                layers' gradients; the default, "token" where the cache has no gradient store), "token" (the same
                positions through the token's active prototypes) or "sequence" (the sequence's whole loss).
        """
        check_reading(reading)
        settings = _settings(studio, prompt, max_new_tokens, temperature, seed)
        _admit(studio, request, settings, 1)
        gen = studio.generate(settings)
        data = attribute_token(studio, gen, index, top=limits.whole("top", top, 1, 50), reading=reading)
        data["sequences"] = [{k: v for k, v in r.items() if k not in ("segments", "sha256")}
                             for r in data["sequences"]]
        return data

    for fn in (generate_explained, explain_token, compare_interventions, training_data):
        gr.api(fn, api_name=fn.__name__, **(model or {}))
    for fn in (search_prototypes, prototype_card):
        gr.api(fn, api_name=fn.__name__)


def hide_page_events(demo: gr.Blocks) -> None:
    """Keep the page's own events (which read and write a browser session's state) out of the MCP tool list:
    Gradio lists every named endpoint as a tool unless its function says it is another kind (its _mcp_type)."""
    for block_fn in demo.fns.values():
        if block_fn.fn is not None and block_fn.api_name not in TOOLS:
            try:
                block_fn.fn._mcp_type = "page"
            except AttributeError:  # a bound method: its function takes no attributes; leave it listed
                continue
