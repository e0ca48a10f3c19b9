"""PRISM in a notebook: the app's explanations as objects that Jupyter shows as HTML (`_repr_html_`), with the app's
category colours and its exact sums, and no server.

    from app.notebook import Notebook
    nb = Notebook.load()                               # the shipped default (assets/), or Notebook.load(model, db)
    gen = nb.generate("The river", max_new_tokens=12)  # shows the text, each token coloured by its top prototype
    tok = nb.explain(gen, 3)                           # shows token 3's logit: residual + one bar per prototype
    nb.card(tok.top_prototype)                         # shows a prototype's card: label, signature, evidence
    nb.generate("The river", suppress=[17])            # shows both texts, the changed tokens marked

Each object keeps its numbers (`.data`, plain dicts as the API returns them), so a cell can check them too: the
slices of `tok.data["chosen"]` and its residual add up to its logit.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

from app import render
from app.core import GenerationSettings, Studio, TokenView
from app.generation import Generation
from app.plots import RESIDUAL_COLOR, category_color
from app.session import Session, scale_item, suppress_item

STYLE = ("font-family: sans-serif; font-size: 13px; line-height: 1.6; max-width: 900px;")
N_BARS = 12  # slices drawn per token; the rest are one grey bar, so the bars still add up to the logit


def _token_span(text: str, colour: str, title: str, changed: bool = False) -> str:
    border = "border-bottom: 3px solid #c0392b;" if changed else ""
    return (f'<span style="background: {colour}33; {border} padding: 1px 0; white-space: pre-wrap;" '
            f'title="{html.escape(title, quote=True)}">{html.escape(text)}</span>')


@dataclass
class GenerationView:
    """A generated text (and the intervened one): Jupyter shows the tokens coloured by their top prototype's
    category (hover: its prototypes), the changed tokens of the intervened text underlined."""

    studio: Studio
    original: Generation
    intervened: Generation | None = None

    @property
    def data(self) -> dict:
        def run(gen: Generation) -> dict:
            return {"text": gen.text, "tokens": [{"index": i, "token": s.text, "token_id": s.token_id,
                                                  "prototypes": s.prototype_ids, "activations": s.activations}
                                                 for i, s in enumerate(gen.steps)]}
        return {"prompt": self.original.prompt_text, "original": run(self.original),
                "intervened": None if self.intervened is None else run(self.intervened), "changed": self.changed}

    @property
    def changed(self) -> list[int]:
        if self.intervened is None:
            return []
        a, b = self.original.token_ids, self.intervened.token_ids
        return [i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]]

    def _run_html(self, gen: Generation, name: str, changed: set[int]) -> str:
        spans = []
        for i, step in enumerate(gen.steps):
            top = step.prototype_ids[0] if step.prototype_ids else None
            label, category = self.studio.label(top) if top is not None else ("", None)
            ids = ", ".join(f"#{p} {a:.2f}" for p, a in zip(step.prototype_ids[:4], step.activations[:4],
                                                            strict=False))
            spans.append(_token_span(step.text, category_color(category),
                                     f"token {i}: {category or 'no prototype'}; {ids}", i in changed))
        return (f'<div><b>{name}</b> <span style="opacity: .7">{html.escape(gen.prompt_text)}</span>'
                f'{"".join(spans)}</div>')

    def _repr_html_(self) -> str:
        parts = [self._run_html(self.original, "original", set())]
        if self.intervened is not None:
            parts.append(self._run_html(self.intervened, "intervened", set(self.changed)))
            parts.append(f'<div style="opacity: .7">{len(self.changed)} token(s) changed; hover a token for its '
                         "prototypes</div>")
        return f'<div style="{STYLE}">{"".join(parts)}</div>'


@dataclass
class TokenExplanation:
    """One token's logit split exactly into residual + one slice per active prototype: Jupyter shows a bar per
    slice (the prototype's category colour), the residual's bar beside them, their sum beside the model's logit,
    the alternatives and the share of the margin over the runner-up that the prototypes carry."""

    view: TokenView

    @property
    def data(self) -> dict:
        return self.view.as_dict()

    @property
    def top_prototype(self) -> int | None:
        slices = sorted(self.view.chosen.slices, key=lambda s: -s.contribution)
        return slices[0].prototype_id if slices else None

    def _repr_html_(self) -> str:
        d = self.view.chosen
        slices = sorted(d.slices, key=lambda s: -abs(s.contribution))
        shown, rest = slices[:N_BARS], slices[N_BARS:]
        rows = [("residual (not explained by prototypes, bias included)", d.residual, RESIDUAL_COLOR)]
        rows += [(f"#{s.prototype_id} {s.label}", s.contribution, category_color(s.category)) for s in shown]
        if rest:
            rows.append((f"{len(rest)} other prototypes", sum(s.contribution for s in rest), "#c7c7c7"))
        scale = max(abs(v) for _, v, _ in rows) or 1.0
        bars = []
        for name, value, colour in rows:
            width = 45 * abs(value) / scale
            left = 50 - width if value < 0 else 50
            bars.append(
                '<tr><td style="padding-right: 8px; max-width: 420px; overflow: hidden; text-overflow: ellipsis; '
                f'white-space: nowrap" title="{html.escape(name, quote=True)}">{html.escape(name)}</td>'
                f'<td style="text-align: right; padding-right: 8px">{value:+.3f}</td>'
                '<td style="width: 300px; position: relative"><div style="position: relative; height: 12px">'
                f'<div style="position: absolute; left: {left:.1f}%; width: {width:.1f}%; height: 12px; '
                f'background: {colour}"></div><div style="position: absolute; left: 50%; width: 1px; '
                'height: 12px; background: #888"></div></div></td></tr>')
        carried = "" if self.view.carried is None else re.sub(  # its markdown bold as HTML (it escapes the token)
            r"\*\*(.+?)\*\*", r"<b>\1</b>", render.carried_line(self.view.carried, self.view.in_prompt))
        alternatives = ", ".join(f"{html.escape(repr(a.token))} {a.logit:.2f}" for a in self.view.alternatives)
        which = "prompt token" if self.view.in_prompt else "token"
        head = (f"<b>{which} {self.view.index} {html.escape(repr(d.token))}</b>: logit {d.logit:.4f} = residual "
                f"{d.residual:+.4f} + prototypes {d.total - d.residual:+.4f} (sum {d.total:.4f})")
        return (f'<div style="{STYLE}"><div>{head}</div><table style="border-collapse: collapse">{"".join(bars)}'
                f'</table><div>{carried}</div><div style="opacity: .7">top tokens here: '
                f"{alternatives}</div></div>")


@dataclass
class CardView:
    """A prototype's card: Jupyter shows its label (fires on / pushes), category, scores, the tokens its
    signature raises and lowers, and its strongest evidence contexts with the token marked."""

    studio: Studio
    card: object  # precompute.query.PrototypeCard
    raises: list[dict]
    lowers: list[dict]

    @property
    def data(self) -> dict:
        out = self.card.as_dict()
        out["raises"], out["lowers"] = self.raises, self.lowers
        return out

    def _repr_html_(self) -> str:
        c = self.card
        colour = category_color(c.category)
        ends = [", ".join(html.escape(repr(t["token"])) for t in ends[:8]) for ends in (self.raises, self.lowers)]
        evidence = "".join(render.evidence_html(e) for e in c.evidence)
        return (f'<div style="{STYLE}"><div><span style="background: {colour}; padding: 0 6px">&nbsp;</span> '
                f"<b>#{c.prototype_id}</b> {html.escape(c.label or '(no label)')} "
                f'<span style="opacity: .7">({html.escape(c.category or "unlabelled")}'
                f'{" / " + html.escape(c.topic) if c.topic else ""})</span></div>'
                f"<div>raises {ends[0]}; lowers {ends[1]}</div>"
                f'<div style="opacity: .7">active at {c.activation_count or 0:,} corpus tokens; label score '
                f"{render.shown_score(c.label_score)}</div>{evidence}</div>")


class Notebook:
    """The app's Studio for a notebook: generate, explain and open cards as displayable objects."""

    def __init__(self, studio: Studio) -> None:
        self.studio = studio

    @classmethod
    def load(cls, model=None, db=None) -> Notebook:
        """The shipped default (assets/) when no model is given, else the model folder and its database."""
        from app.assets import resolve_db, resolve_model

        model_path = resolve_model(model)
        return cls(Studio.load(model_path, resolve_db(db, model_given=model is not None)))

    def _interventions(self, suppress, scale):
        session = Session()
        for pid in suppress or []:
            session = session.add(suppress_item(self.studio.check_prototype(pid)))
        for pid, factor in (scale or {}).items():
            session = session.add(scale_item(self.studio.check_prototype(pid), float(factor)))
        return session.interventions() if session.items else None

    def generate(self, prompt: str, max_new_tokens: int = 24, suppress=None, scale=None, temperature: float = 0.0,
                 seed: int = 0) -> GenerationView:
        """The continuation and, with suppress (ids, re-routed as in the app) or scale ({id: factor}), the
        intervened one."""
        settings = self.studio.check_settings(GenerationSettings(prompt, max_new_tokens, temperature, 1.0, seed))
        interventions = self._interventions(suppress, scale)
        original = self.studio.generate(settings)
        intervened = self.studio.generate(settings, interventions) if interventions is not None else None
        return GenerationView(self.studio, original, intervened)

    def explain(self, gen: GenerationView, index: int, intervened: bool = False,
                alternatives: int = 5) -> TokenExplanation:
        """Generated token `index` of the original text (or of the intervened one)."""
        text = gen.intervened if intervened else gen.original
        if text is None:
            raise ValueError("this generation has no intervened text: generate with suppress or scale")
        return TokenExplanation(self.studio.explain(text, index, n_alternatives=alternatives))

    def card(self, prototype_id: int, n_evidence: int = 4) -> CardView:
        pid = self.studio.check_prototype(prototype_id)
        raises, lowers = self.studio.signature_ends(pid)
        return CardView(self.studio, self.studio.need_db().card(pid, n_evidence=n_evidence), raises, lowers)
