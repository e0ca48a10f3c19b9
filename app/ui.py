"""The Gradio page: one `with gr.Blocks()` layout (build_demo) wiring the handlers of app/handlers.py, and launch.

    python app.py            # serves it; see python app.py --help
"""

from __future__ import annotations

import html
import signal
import threading
from functools import partial

import gradio as gr
from starlette.middleware import Middleware

from app import controllers as app_controllers
from app import handlers as h
from app import interventions as iv
from app import plots, tools, training_data
from app.attribution import BUILDING, DEFAULT_READING, READING_CHOICES, build_status_html
from app.attribution import EMPTY as EMPTY_ATTRIBUTION
from app.cards import NO_CARD_PLOT
from app.cards import NO_PROTOTYPE as NO_CARD
from app.core import NEVER_ACTIVE, NO_PROTOTYPE, Studio
from app.limits import Limits, RequestLimiter
from app.messages import checked_inputs
from app.panels import ControllerPanel, InterventionsPanel
from app.session import MAX_INJECT, SUPPRESS_MODE_NAMES, Session

CSS = """
.prism-evidence { border-left: 3px solid #ddd; padding: 4px 8px; margin: 6px 0; font-family: monospace; }
.prism-evidence-source { opacity: 0.75; font-size: 0.85em; font-family: sans-serif; }
.prism-band { margin: 10px 0 2px 0; }
/* the two texts as text: each token a clickable span with its own spaces and line breaks, not a row of pills;
   font-size 0 around the token's text hides the blanks between Gradio's elements */
#original .textfield,
#intervened .textfield,
#prompt-tokens .textfield {
  display: block; word-break: normal; overflow-wrap: anywhere; line-height: 1.7; font-size: 0; }
#original .token-container,
#intervened .token-container,
#prompt-tokens .token-container { display: inline; font-size: 0; }
#original .token,
#intervened .token,
#prompt-tokens .token {
  display: inline-block; padding: 0; margin: 0; font-size: 0; max-width: 100%; vertical-align: top; }
#original .token .text,
#intervened .token .text,
#prompt-tokens .token .text {
  font-size: var(--text-md); white-space: pre-wrap; background-color: inherit; border-radius: 2px; }
#original .line-break,
#intervened .line-break,
#prompt-tokens .line-break { display: block; }
#prism-legend { font-size: 11px; line-height: 1.5; opacity: 0.85; }
#prism-legend .chip { display: inline-block; width: 9px; height: 9px; border-radius: 2px; margin: 0 2px 0 6px;
  vertical-align: -1px; }
/* charts follow the dark theme: transparent panels, light text and grid lines */
.dark .js-plotly-plot .main-svg text { fill: #e5e7eb !important; }
.dark .js-plotly-plot .gridlayer path, .dark .js-plotly-plot .zerolinelayer path { stroke: #4b5563 !important; }
.dark .js-plotly-plot .shapelayer path { stroke: #e5e7eb !important; }
.dark .js-plotly-plot .scatterlayer .point { fill: #e5e7eb !important; }
"""

# A click on a map point or on a prototype's bar in the decomposition, alternatives or contrast chart, or on a
# #prototype-N link in a card, writes the prototype id (a point's customdata; -1 for the residual and sums) into the
# prototype id box and presses Open card.
CLICK_JS = """
() => {
  const charts = ['#prototype-map', '#decomposition', '#alternatives', '#contrast-plot'];
  const openCard = (id) => {
    if (!Number.isInteger(id) || id < 0) return;
    const box = document.querySelector('#proto-id input');
    box.value = String(id);
    box.dispatchEvent(new Event('input', {bubbles: true}));
    box.dispatchEvent(new Event('change', {bubbles: true}));
    setTimeout(() => document.querySelector('#open-card').click(), 100);
  };
  const hook = () => {
    for (const chart of charts) {
      const plot = document.querySelector(chart + ' .js-plotly-plot');
      if (!plot || plot.__prismHooked || !plot.on) continue;
      plot.__prismHooked = true;
      plot.on('plotly_click', (ev) => {
        const point = ev && ev.points && ev.points[0];
        openCard(point ? Number(point.customdata) : NaN);
      });
    }
  };
  new MutationObserver(hook).observe(document.body, {childList: true, subtree: true});
  // a #prototype-N link (a card's siblings and co-active prototypes) opens that card in place
  document.addEventListener('click', (ev) => {
    const link = ev.target.closest && ev.target.closest('a[href^="#prototype-"]');
    if (!link) return;
    ev.preventDefault();
    openCard(Number(link.getAttribute('href').slice('#prototype-'.length)));
  });
}
"""

# The prompt's tokens: each one a muted colour, the first (nothing before it predicts it) paler still
PROMPT_COLOURS = {h.PROMPT_TOKEN: "#cbd5e1", h.PROMPT_FIRST: "#f1f5f9"}

INTRO = """# PRISM studio
Every token's score splits **exactly** into a residual plus one slice per active prototype. Generate, click a token
to see why, then switch a prototype off or up and compare."""

GLOSSARY_TERMS = (
    ("logit", "the model's raw score for a token; the highest is written (greedy); softmax turns the scores into "
              "**probabilities** (p)"),
    ("prototype", "a learned direction in the model's hidden state, named by a **label** and shown in real "
                  "training text (its **evidence**)"),
    ("activation", "how strongly a prototype is present at a token (0: not at all); a few are active at each token"),
    ("logit signature", "W·p: what a prototype adds to every token's logit per unit of activation"),
    ("slice", "one prototype's part of a logit: its activation times its signature for that token"),
    ("residual", "the part of the hidden state no prototype explains, and its part of the logit (W·r + b); shown "
                 "beside the slices, so you see how much they explain"),
    ("label score", "how well a label tells the prototype's own contexts from others' (0.5: chance, 1: perfect)"),
    ("category", "the kind of thing a label names; a token's colour is its top prototype's category"),
    ("suppress", "switch a prototype off: **re-route** gives its slot to the nearest others (the text stays "
                 "fluent), **remove** drops its slice (exact subtraction)"),
    ("scale / inject", "multiply an active prototype's activation / make a prototype active where it is not"),
    ("contrast", "why token A and not B: their logit gap split into the residual's part and each prototype's"),
    ("training data", "the training sequences that most raised this token's logit (influence, from the "
                      "attribution cache)"),
)
GLOSSARY = "| term | what it means here |\n|---|---|\n" + "\n".join(
    f"| **{term}** | {meaning} |" for term, meaning in GLOSSARY_TERMS)


class Components(dict):
    """Every component an event reads or writes, by the name the handlers' panels use (app/handlers.py)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def outputs(self, *panels) -> list:
        """The components of a panel's fields (a NamedTuple class) or of names, in that order."""
        names = [n for p in panels for n in (p._fields if isinstance(p, type) else [p])]
        return [self[n] for n in names]


def build_demo(studio: Studio, concurrency: int = 2) -> gr.Blocks:
    """The one Blocks layout; `concurrency` bounds how many generations run at once (they share the CPU)."""
    lim = studio.limits
    c = Components()
    # Uploads and the files handlers return live in Gradio's cache: swept every 10 minutes, gone after file_max_age_s.
    with gr.Blocks(title="PRISM studio", delete_cache=(600, lim.file_max_age_s)) as demo:
        # an idle session's texts and interventions are dropped after session_ttl_s (launch bounds their number)
        c["session"] = gr.State(Session(), time_to_live=lim.session_ttl_s)
        c["control"] = gr.State(h.RunControl(), time_to_live=lim.session_ttl_s)
        c["pending"] = gr.State(None, time_to_live=lim.session_ttl_s)
        gr.Markdown(INTRO + _database_note(studio), elem_id="intro")
        with gr.Accordion("What the words mean", open=False, elem_id="glossary"):
            gr.Markdown(GLOSSARY)
        with gr.Row():
            with gr.Column(scale=3):
                with gr.Tabs() as c["tabs"]:
                    with gr.Tab("Generate", id="generate"):
                        _generate_panel(c, studio)
                    with gr.Tab("Prototypes", id="browse"):
                        _browse_panel(c, studio)
            with gr.Column(scale=2):
                _card_panel(c)
                _interventions_panel(c, studio)
                _controller_panel(c, studio)
        _wire(c, studio, concurrency, demo)
    checked_inputs(demo)
    return demo


def _first_attribution_note(studio: Studio):
    """The panel's first content: the first-start build's line while it runs (a callable: each page load reads it
    afresh), else the hint to click a token."""
    build = training_data.builder_for(studio)
    if build is None or build.database() is not None:
        return EMPTY_ATTRIBUTION
    return lambda: build_status_html(build.status()) if build.database() is None else EMPTY_ATTRIBUTION


def _training_data_status(studio: Studio, panel: gr.HTML) -> None:
    """While the first-start build of the training-data cache runs (app/training_data.py): its progress line in the
    panel, one line (the click's answer says the same), refreshed every 5 s until the cache is ready, and only while
    the panel shows no sequences."""
    build = training_data.builder_for(studio)
    if build is None:
        return
    timer = gr.Timer(5, active=build.database() is None)

    def tick(shown: str | None):
        running = gr.Timer(active=build.database() is None)
        if shown in (None, "", EMPTY_ATTRIBUTION) or BUILDING in shown:
            return build_status_html(build.status()), running
        return gr.skip(), running

    timer.tick(tick, [panel], [panel, timer], api_name=False, show_progress="hidden", queue=False)


def _database_note(studio: Studio) -> str:
    note = "" if studio.db is not None else f"\n\n⚠️ {html.escape(studio.db_error or '')} " + \
        "No precompute database: labels, categories and evidence are off. Build one with `python -m precompute " \
        "build --model MODEL --corpus CORPUS --db out.duckdb` and start with `--db out.duckdb`."
    check = studio.db.text_check if studio.db is not None else None
    if check and check["errors"]:
        note += (f"\n\n⚠️ {check['documents'] - check['resolved']} of {check['documents']} evidence documents "
                 f"could not be read back from the installed corpus packages, so their snippets are hidden: "
                 f"{html.escape(check['errors'][0])}")
    return note


def _legend(color_map: dict[str, str]) -> str:
    """One small line under the texts: what a token's colour says (its top prototype's category)."""
    chips = "".join(f"<span class='chip' style='background:{html.escape(colour)}'></span>{html.escape(name)}"
                    for name, colour in color_map.items())
    return f"<div>Colour: the token's top prototype's category{chips}</div>"


def _generate_panel(c: Components, studio: Studio) -> None:
    """The prompt and settings, the two texts side by side, links and exports, one token's explanation."""
    lim = studio.limits
    # the legend: the categories the browser's filter offers, then what colours only tokens
    color_map = {k: plots.category_color(k) for k in [*studio.filters(), NO_PROTOTYPE] if k != NEVER_ACTIVE}
    color_map[h.CHANGED] = "#ff2d2d"
    with gr.Row(equal_height=True):
        c["prompt"] = gr.Textbox(label="Prompt", lines=2, scale=4, elem_id="prompt",
                                 value="The river flows into the", max_length=lim.max_prompt_chars,
                                 info=f"at most {lim.max_prompt_tokens} tokens")
        with gr.Column(scale=1, min_width=120):
            c["generate_btn"] = gr.Button("Generate", variant="primary", elem_id="generate")
            c["stop_btn"] = gr.Button("Stop", variant="stop", elem_id="stop")
            c["stop_shown"] = gr.Textbox(visible=False)  # the tokens on the page when Stop was clicked (STOP_JS)
    with gr.Row(elem_id="settings"):
        c["max_new"] = gr.Slider(1, lim.max_new_tokens, value=min(24, lim.max_new_tokens), step=1,
                                 label="Max new tokens", elem_id="max-new", min_width=140)
        c["temperature"] = gr.Slider(0, 2, value=0, step=0.05, label="Temperature", elem_id="temperature",
                                     info=None, min_width=140)
        c["top_p"] = gr.Slider(0.05, 1, value=1, step=0.05, label="Top-p", elem_id="top-p", min_width=140)
        c["seed"] = gr.Number(value=0, step=1, label="Seed", elem_id="seed", min_width=90)
    c["gen_status"] = gr.Markdown(elem_id="gen-status")
    with gr.Row(equal_height=False):
        with gr.Column(min_width=160):
            gr.Markdown("**Original** (no interventions)", elem_id="original-title")
            c["original"] = gr.HighlightedText(label="Original", color_map=color_map, show_legend=False,
                                               show_label=False, show_inline_category=False, elem_id="original")
        with gr.Column(min_width=160):
            c["intervened_title"] = gr.Markdown(h.INTERVENED_TITLE, elem_id="intervened-title")
            c["intervened"] = gr.HighlightedText(label="Intervened", color_map=color_map, show_legend=False,
                                                 show_label=False, show_inline_category=False, elem_id="intervened")
    gr.HTML(_legend(color_map), elem_id="prism-legend")
    with gr.Row(elem_id="share-row"):
        c["link_btn"] = gr.Button("Copy link", size="sm", elem_id="copy-link")
        c["export_gen_btn"] = gr.Button("Export generation (JSON)", size="sm", elem_id="export-gen")
        c["export_iv_btn"] = gr.Button("Export interventions (JSON)", size="sm", elem_id="export-iv")
        c["import_iv_btn"] = gr.UploadButton("Import interventions", size="sm", file_types=[".json"],
                                             type="filepath", elem_id="import-iv")
    c["share_status"] = gr.Markdown(elem_id="share-status")
    c["link_box"] = gr.Textbox(label="Link to this state", visible=False, interactive=False, buttons=["copy"],
                               elem_id="link", max_lines=1)
    c["export_file"] = gr.File(label="Download", interactive=False, elem_id="export-file", visible=False)
    with gr.Row():
        c["run"] = gr.Radio(list(h.RUNS), value="original", label="Text", scale=1, elem_id="run")
        c["index"] = gr.Number(value=0, step=1, label="Token index", scale=1, elem_id="token-index")
        c["decompose_btn"] = gr.Button("Explain token", scale=1, elem_id="explain")
    with gr.Accordion("The prompt, token by token (click one: what the model expected there)", open=False,
                      elem_id="prompt-panel"):
        c["prompt_tokens"] = gr.HighlightedText(color_map=PROMPT_COLOURS, show_legend=False, show_label=False,
                                                show_inline_category=False, elem_id="prompt-tokens")
    c["token_md"] = gr.Markdown(elem_id="token-summary")
    c["waterfall"] = gr.Plot(label="Decomposition", elem_id="decomposition")
    c["alternatives"] = gr.Plot(label="Alternatives", elem_id="alternatives")
    with gr.Row():
        c["contrast_box"] = gr.Textbox(label="Why this token and not…", placeholder="another token, e.g. ' city'",
                                       scale=3, elem_id="contrast-token", max_length=200)
        c["contrast_btn"] = gr.Button("Compare", scale=1, elem_id="contrast")
    c["contrast_md"] = gr.Markdown(elem_id="contrast-summary")
    c["contrast_plot"] = gr.Plot(label="Contrast", elem_id="contrast-plot")
    c["contrast_json"] = gr.JSON(visible=False)
    c["active"] = gr.Dataframe(headers=h.ACTIVE_HEADERS, label="Active prototypes (click a row)", interactive=False,
                               elem_id="active", wrap=True, column_widths=["44px", "226px", "130px", "112px", "130px"])
    with gr.Accordion("Training data behind this token", open=True, elem_id="attribution-panel"):
        with gr.Row():
            c["attribute_btn"] = gr.Button("Find the training data", elem_id="attribute", scale=1)
            c["reading"] = gr.Radio(READING_CHOICES, value=DEFAULT_READING, label="Count a training sequence by",
                                    elem_id="attribution-reading", scale=2)
        c["attribution_html"] = gr.HTML(_first_attribution_note(studio), elem_id="attribution")
        _training_data_status(studio, c["attribution_html"])
        c["attribution_json"] = gr.JSON(visible=False)
    with gr.Accordion("Data (as the API returns it)", open=False):
        c["result_json"] = gr.JSON(label="generate")
        c["token_json"] = gr.JSON(label="decompose")


def _browse_panel(c: Components, studio: Studio) -> None:
    """Search, filter and sort the prototypes; the table and the map."""
    with gr.Row():
        c["query_box"] = gr.Textbox(label="Search", placeholder="e.g. year, suffix, a hospital", scale=3,
                                    elem_id="search-box")
        c["mode"] = gr.Radio(["label", "semantic", h.PUSHES], value="label", label="Search by", scale=1,
                             info=f"{h.PUSHES}: who raises a token's logit most, e.g. ' Paris'")
        c["category"] = gr.Dropdown(["all", *studio.filters()], value="all", label="Category", scale=1,
                                    elem_id="category-filter")
        c["order"] = gr.Dropdown(list(h.ORDERINGS), value="relevance", label="Sort by", scale=1, elem_id="order")
    with gr.Row():
        c["search_btn"] = gr.Button("Search", variant="primary", elem_id="search", scale=3)
        c["export_table_btn"] = gr.Button("Export all prototypes (CSV)", scale=1, elem_id="export-table")
    c["table_file"] = gr.File(label="Download", interactive=False, elem_id="table-file", visible=False)
    c["search_status"] = gr.Markdown(elem_id="search-status")
    c["table"] = gr.Dataframe(headers=h.TABLE_HEADERS, interactive=False, label="Prototypes (click a row)",
                              elem_id="table", max_height=360, column_widths=h.TABLE_WIDTHS, wrap=True)
    c["proto_map"] = gr.Plot(label="Map", elem_id="prototype-map")


def _card_panel(c: Components) -> None:
    """One prototype: open it by id, suppress or scale it, its card and evidence."""
    gr.Markdown("### Prototype")
    with gr.Row():
        c["proto_id"] = gr.Number(label="Prototype id", step=1, elem_id="proto-id", scale=2)
        c["open_btn"] = gr.Button("Open card", scale=1, elem_id="open-card")
    with gr.Row():
        c["suppress_btn"] = gr.Button("Suppress", variant="stop", elem_id="suppress")
        c["factor"] = gr.Slider(0, 5, value=2, step=0.1, label="Scale factor", elem_id="factor")
        c["scale_btn"] = gr.Button("Scale", elem_id="scale")
    with gr.Row():
        c["inject_value"] = gr.Number(value=2.0, minimum=0, maximum=MAX_INJECT, step=0.5, label="Activation",
                                      elem_id="inject-value", scale=2,
                                      info="active at every token, even where the model does not select it")
        c["inject_btn"] = gr.Button("Inject", elem_id="inject", scale=1)
    # what the card says before one is opened (a page load opens one only for a ?prototype= link)
    c["card_md"] = gr.Markdown(NO_CARD, elem_id="card")
    c["evidence"] = gr.HTML(elem_id="evidence")
    with gr.Accordion("Try it on your text", open=False, elem_id="try-panel"):
        with gr.Row():
            c["try_box"] = gr.Textbox(label="A text", placeholder="type or paste a text; see this prototype's "
                                      "activation on every token", lines=2, scale=4, elem_id="try-text",
                                      max_length=4000)
            c["try_btn"] = gr.Button("Run", scale=1, elem_id="try-run")
        c["try_html"] = gr.HTML(elem_id="try-result")
        c["try_json"] = gr.JSON(visible=False)
    with gr.Row():
        c["export_ev_btn"] = gr.Button("Export this prototype's evidence (CSV)", size="sm", elem_id="export-evidence")
    c["evidence_file"] = gr.File(label="Download", interactive=False, elem_id="evidence-file", visible=False)
    c["signature"] = gr.Plot(plots.empty_figure(NO_CARD_PLOT), label="Logit signature")
    c["histogram"] = gr.Plot(plots.empty_figure(NO_CARD_PLOT), label="Activation histogram")
    c["card_json"] = gr.JSON(visible=False)


def _interventions_panel(c: Components, studio: Studio) -> None:
    """The user's intervention list and the ways to add to it (a category, a search, a preset)."""
    gr.Markdown("### Your interventions")
    c["iv_status"] = gr.Markdown(elem_id="iv-status")
    c["iv_table"] = gr.Dataframe(headers=h.INTERVENTION_HEADERS, interactive=False, elem_id="interventions")
    c["iv_suppress_mode"] = gr.Radio(
        [(name, mode) for mode, name in SUPPRESS_MODE_NAMES.items()], value=Session().suppress_mode,
        label="A suppressed prototype is switched off by", elem_id="suppress-mode",
        info="re-route: the nearest other prototypes take its slot and the text stays fluent; remove the slice: its "
             "share of the state is simply missing (exact subtraction)")
    with gr.Row():
        c["remove_index"] = gr.Number(value=0, step=1, label="#", scale=1)
        c["remove_btn"] = gr.Button("Remove", scale=1)
        c["clear_btn"] = gr.Button("Clear all", scale=1)
    presets = studio.presets()
    with gr.Row():
        c["iv_preset"] = gr.Dropdown([p["title"] for p in presets], label="Preset (one click)", scale=2,
                                     value=presets[0]["title"] if presets else None, elem_id="preset",
                                     info="; ".join(f"{p['title']}: {p['n']} prototypes" for p in presets)
                                     or "this database has no presets (python -m precompute.presets)")
        c["preset_btn"] = gr.Button("Apply preset", scale=1, elem_id="preset-apply")
    with gr.Row():
        c["iv_category"] = gr.Dropdown(studio.db.categories if studio.db is not None else [], label="Category",
                                       scale=2)
        c["category_btn"] = gr.Button("Suppress category", scale=1)
    with gr.Row():
        c["iv_search"] = gr.Textbox(label="Every prototype matching", scale=2)
        c["iv_mode"] = gr.Radio(["label", "semantic"], value="label", label="by", scale=1)
        c["iv_search_btn"] = gr.Button("Suppress all", scale=1)
    c["iv_repr"] = gr.Textbox(visible=False)
    c["iv_refresh"] = gr.Button(visible=False)


def _controller_panel(c: Components, studio: Studio) -> None:
    """A fitted controller: pick a shipped one or a file, see what it moves, switch it on."""
    with gr.Accordion("Controller", open=False, elem_id="controller-panel"):
        gr.Markdown("A fitted controller reweights prototypes wherever they are active "
                    "(`python -m bench.controllers fit`). Load one, see what it moves, switch it on.")
        shipped = list(app_controllers.shipped(studio))
        c["ctl_shipped"] = gr.Dropdown(shipped, value=shipped[0] if shipped else None, label="Shipped controller",
                                       elem_id="ctl-shipped", info=None if shipped else "none shipped for this model")
        c["ctl_path"] = gr.Textbox(label="or a controller file on the server (.safetensors)", elem_id="ctl-path",
                                   visible=studio.limits.server_paths)
        c["ctl_upload"] = gr.File(label="or upload one", file_types=[".safetensors"], type="filepath",
                                  elem_id="ctl-upload")
        c["ctl_on"] = gr.Checkbox(value=True, label="Use it for the intervened text", elem_id="ctl-on")
        c["ctl_btn"] = gr.Button("Load / apply", elem_id="ctl-apply")
        c["ctl_status"] = gr.Markdown(elem_id="ctl-status")
        c["ctl_table"] = gr.Dataframe(headers=h.CONTROLLER_HEADERS, interactive=False, elem_id="ctl-table",
                                      label="Most raised and lowered prototypes (click a row)")
        c["ctl_json"] = gr.JSON(visible=False)


def _wire(c: Components, studio: Studio, concurrency: int, demo: gr.Blocks) -> None:
    """Every event: which handler, reading which components, writing which panel."""
    card = c.outputs(h.CardPanel)
    ivs = c.outputs(InterventionsPanel)
    settings = c.outputs("prompt", "max_new", "temperature", "top_p", "seed")
    # Everything that runs the model (generation, a token's decomposition, training data, exports, a restored
    # link), named or hidden, shares one concurrency group: at most `concurrency` at once, whoever calls.
    model = {"concurrency_limit": concurrency, "concurrency_id": "model"}
    tools.register(studio, model)  # the agents' stateless endpoints (app/tools.py), in the same model group
    open_card = partial(h.prototype, studio)

    # Gradio passes gr.Request only to functions whose own annotations name it (not through a partial): the
    # session hash admits each generation by its cost (limits.CostBudget).
    def generate_for(prompt, max_new, temperature, top_p, seed, session, control, request: gr.Request):
        yield from h.generate(studio, prompt, max_new, temperature, top_p, seed, session, control,
                              session_hash=getattr(request, "session_hash", None))

    def pending_for(pending, prompt, max_new, temperature, top_p, seed, session, control, request: gr.Request):
        yield from h.generate_pending(studio, pending, prompt, max_new, temperature, top_p, seed, session,
                                      session_hash=getattr(request, "session_hash", None), control=control)

    prompt_tokens = partial(h.prompt_tokens, studio)
    c.generate_btn.click(h.clear_explanation, [c.control], c.outputs(h.ClearPanel), api_name=False,
                         queue=False).then(generate_for, [*settings, c.session, c.control],
                                           c.outputs(h.GenerationPanel), api_name="generate", **model).then(
        prompt_tokens, [c.session], [c.prompt_tokens], api_name=False, queue=False, show_progress="hidden")
    # Stop runs outside the queue; its page-side half (STOP_JS) sends how many tokens each column shows
    c.stop_btn.click(partial(h.request_stop, studio), [c.control, c.stop_shown, c.session],
                     c.outputs(h.GenerationPanel), js=h.STOP_JS, api_name=False, queue=False, show_progress="hidden")
    token = c.outputs(h.TokenPanel)
    c.decompose_btn.click(partial(h.decompose, studio), [c.run, c.index, c.session], token, api_name="decompose",
                          **model).then(open_card, [c.proto_id], card, api_name=False)
    for select, component in ((h.select_original, c.original), (h.select_intervened, c.intervened),
                              (h.select_prompt, c.prompt_tokens)):
        component.select(select, None, [c.run, c.index], api_name=False).then(
            partial(h.decompose, studio), [c.run, c.index, c.session], token, api_name=False, **model).then(
            open_card, [c.proto_id], card, api_name=False)
    c.open_btn.click(open_card, [c.proto_id], card, api_name="prototype")
    tried = c.outputs("try_html", "try_json")
    c.try_btn.click(partial(h.try_text, studio), [c.proto_id, c.try_box], tried, api_name="try_prototype", **model)
    c.try_box.submit(partial(h.try_text, studio), [c.proto_id, c.try_box], tried, api_name=False, **model)
    compared = c.outputs("contrast_plot", "contrast_md", "contrast_json")
    contrast_inputs = [c.run, c.index, c.contrast_box, c.session]
    c.contrast_btn.click(partial(h.contrast, studio), contrast_inputs, compared, api_name="contrast", **model)
    c.contrast_box.submit(partial(h.contrast, studio), contrast_inputs, compared, api_name=False, **model)

    def pick_row(evt: gr.SelectData):
        return evt.row_value[0]

    for frame in (c.active, c.table):
        frame.select(pick_row, None, [c.proto_id], api_name=False).then(open_card, [c.proto_id], card, api_name=False)

    search_inputs = [c.query_box, c.mode, c.category, c.order]
    map_inputs = [c.query_box, c.table, c.card_json, c.category]
    found = c.outputs("table", "search_status")
    c.search_btn.click(partial(h.search, studio), search_inputs, found, api_name="search").then(
        partial(h.map_plot, studio), map_inputs, [c.proto_map], api_name=False)
    for trigger in (c.query_box.submit, c.mode.input, c.category.input, c.order.input):  # every change applies
        trigger(partial(h.search, studio), search_inputs, found, api_name=False).then(
            partial(h.map_plot, studio), map_inputs, [c.proto_map], api_name=False)
    c.card_json.change(partial(h.map_plot, studio), map_inputs, [c.proto_map], api_name=False)

    c.suppress_btn.click(partial(iv.suppress, studio), [c.proto_id, c.session], ivs, api_name="suppress")
    c.scale_btn.click(partial(iv.scale, studio), [c.proto_id, c.factor, c.session], ivs, api_name="scale")
    c.inject_btn.click(partial(iv.inject, studio), [c.proto_id, c.inject_value, c.session], ivs, api_name="inject")
    c.category_btn.click(partial(iv.suppress_category, studio), [c.iv_category, c.session], ivs,
                         api_name="suppress_category")
    c.iv_search_btn.click(partial(iv.suppress_search, studio), [c.iv_search, c.iv_mode, c.session], ivs,
                          api_name="suppress_search")
    c.preset_btn.click(partial(iv.apply_preset, studio), [c.iv_preset, c.session], ivs, api_name="preset")
    c.iv_suppress_mode.input(iv.suppress_mode, [c.iv_suppress_mode, c.session], ivs, api_name="suppress_mode")
    c.remove_btn.click(iv.remove_intervention, [c.remove_index, c.session], ivs, api_name="remove_intervention")
    c.clear_btn.click(iv.clear_interventions, [c.session], ivs, api_name="clear_interventions")
    listed = c.outputs("iv_table", "iv_repr")
    c.iv_refresh.click(iv.list_interventions, [c.session], listed, api_name="interventions")
    c.ctl_btn.click(partial(iv.controller, studio), [c.ctl_path, c.ctl_upload, c.ctl_on, c.session, c.ctl_shipped],
                    c.outputs(ControllerPanel), api_name="controller", **model).then(
        iv.list_interventions, [c.session], listed, api_name=False)
    c.ctl_table.select(iv.pick_controller_row, None, [c.proto_id], api_name=False).then(
        open_card, [c.proto_id], card, api_name=False)

    # Training data behind the selected token: on request, and whenever a token's decomposition arrives.
    attribution = c.outputs("attribution_html", "attribution_json")
    c.attribute_btn.click(partial(h.attribute, studio), [c.run, c.index, c.session, c.reading], attribution,
                          api_name="attribute", **model)
    c.token_json.change(partial(h.refresh_attribution, studio),
                        [c.token_json, c.run, c.index, c.session, c.reading], attribution, api_name=False, **model)
    c.reading.change(partial(h.refresh_attribution, studio),
                     [c.token_json, c.run, c.index, c.session, c.reading], attribution, api_name=False, **model)

    # Links, exports, imports. Gradio passes gr.Request only to functions whose own annotations name it (not
    # through a partial).
    def link_for(prompt, max_new, temperature, top_p, seed, run, token, session, request: gr.Request):
        return h.share_link(studio, prompt, max_new, temperature, top_p, seed, run, token, session, request)

    def restore_for(session, request: gr.Request):
        return h.restore_link(studio, session, request)

    c.link_btn.click(link_for, [*settings, c.run, c.token_json, c.session], c.outputs("link_box", "share_status"),
                     api_name="link").then(
        None, [c.link_box], None, api_name=False,
        js="(url) => { if (url && navigator.clipboard) navigator.clipboard.writeText(url).catch(() => {}); }").then(
        h._shown_if_set, [c.link_box], [c.link_box], api_name=False)
    # a link on screen stops being one to this state when the interventions or the settings change: it is cleared
    for changed in (c.iv_table, *settings):
        changed.change(h.link_stale, [c.link_box], c.outputs("link_box", "share_status"), api_name=False,
                       queue=False, show_progress="hidden")
    for button, fn, inputs, target, status, name, extra in (
            (c.export_gen_btn, h.export_generation, [c.session], "export_file", "share_status", "export_generation",
             model),
            (c.export_iv_btn, h.export_interventions, [c.session], "export_file", "share_status",
             "export_interventions", {}),
            (c.export_table_btn, h.export_table, [], "table_file", "search_status", "export_table", {}),
            (c.export_ev_btn, h.export_evidence, [c.proto_id], "evidence_file", "iv_status", "export_evidence", {})):
        button.click(partial(fn, studio), inputs or None, c.outputs(target, status), api_name=name, **extra).then(
            h._shown_if_set, [c[target]], [c[target]], api_name=False)
    c.import_iv_btn.upload(partial(h.import_interventions, studio), [c.import_iv_btn, c.session],
                           c.outputs(InterventionsPanel, "iv_suppress_mode"), api_name="import_interventions")
    demo.load(restore_for, [c.session], c.outputs(h.RestorePanel), api_name=False).then(
        pending_for, [c.pending, *settings, c.session, c.control], c.outputs(h.GenerationPanel), api_name=False,
        **model).then(prompt_tokens, [c.session], [c.prompt_tokens], api_name=False, queue=False,
                      show_progress="hidden").then(
        partial(h.select_pending, studio), [c.pending, c.session], c.outputs(h.PendingPanel), api_name=False,
        **model)

    demo.load(partial(h.search, studio), search_inputs, found, api_name=False).then(
        partial(h.map_plot, studio), map_inputs, [c.proto_map], api_name="map")
    def deep_link_card(proto_id, request: gr.Request):
        return h.deep_link_card(studio, proto_id, request)

    # Gradio draws an empty Number as 0, and Suppress would then act on prototype 0: the page empties the box as it
    # loads, in the page itself and only while it still holds that 0, so an id typed at once stays
    demo.load(None, [c.proto_id], [c.proto_id], js="(v) => (v === 0 ? null : v)", api_name=False)
    demo.load(h.deep_link, None, [c.proto_id, c.tabs], api_name=False).then(deep_link_card, [c.proto_id], card,
                                                                           api_name=False)


def stop_on_sigterm() -> None:
    """`kill` (SIGTERM: a Space stopping, a service manager, a test) ends a blocking app as Ctrl-C does: Gradio
    closes the server and the exit handlers run, so the training-data cache's child (app/training_data.py) stops
    with its app, to resume on the next start, instead of living on alone. Only the main thread installs it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)


def launch(demo: gr.Blocks, host: str | None = None, port: int | None = None, share: bool = False,
           concurrency: int = 2, block: bool = True, limits: Limits | None = None, mcp: bool = False):
    """Queue (at most `concurrency` model events at once, 64 waiting), limit each session's requests (RequestLimiter
    in front of the queue), bound uploads and kept sessions, and serve. host None: GRADIO_SERVER_NAME when it is
    set, else 127.0.0.1. Errors reach users only as the handlers' own messages (show_error=False)."""
    limits = limits or Limits()

    def pending(session_hash: str, fn_index: int | None) -> tuple[int, int, bool]:
        """What Gradio's queue holds for a session: (its events, those in fn_index's concurrency group, whether
        that group is the model's). Reads the queue's own bookkeeping (Gradio 6); tests/test_app_limits.py checks
        the refusals this drives, so a Gradio that renames it fails there."""
        queue = demo._queue
        ids = queue.pending_event_ids_session.get(session_hash, ())
        fn = demo.fns.get(fn_index) if fn_index is not None else None
        group = getattr(fn, "concurrency_id", None)
        same = sum(getattr(queue.event_ids_to_events.get(i), "concurrency_id", None) == group for i in ids)
        return len(ids), same, group == "model"

    demo.queue(default_concurrency_limit=max(concurrency, 4), max_size=64)
    if mcp:  # Gradio's own MCP server lists every named endpoint: only app/tools.py's, not the page's events
        tools.hide_page_events(demo)
    if block:
        stop_on_sigterm()
    try:
        return demo.launch(server_name=host, server_port=port, share=share, prevent_thread_lock=not block,
                           css=CSS, js=CLICK_JS, theme=gr.themes.Soft(), footer_links=["api"], quiet=True,
                           show_error=False, max_file_size=limits.max_upload_bytes, mcp_server=mcp,
                           state_session_capacity=limits.max_sessions,
                           app_kwargs={"middleware": [Middleware(RequestLimiter, limits=limits, pending=pending,
                                                              known_event=lambda fn: fn in demo.fns,
                                                              n_inputs=lambda fn: len(demo.fns[fn].inputs))]})
    except KeyboardInterrupt:
        # Ctrl-C or SIGTERM while Gradio still checks that its page answers, before its own wait (which closes
        # quietly) began: the server already runs, so close it the same way and end normally (exit code 0). Seen
        # once under a loaded test run: a kill in that second ended the app with a traceback and exit code 1.
        demo.close()
        return None
