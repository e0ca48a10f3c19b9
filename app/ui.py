"""The Gradio page: one `with gr.Blocks()` layout (build_demo) wiring the handlers of app/handlers.py, and launch.

    python app.py            # serves it; see python app.py --help
"""

from __future__ import annotations

import html
from functools import partial

import gradio as gr
from starlette.middleware import Middleware

from app import controllers as app_controllers
from app import handlers as h
from app import interventions as iv
from app import plots
from app.attribution import EMPTY as EMPTY_ATTRIBUTION
from app.core import NEVER_ACTIVE, NO_PROTOTYPE, Studio
from app.limits import Limits, RequestLimiter
from app.session import SUPPRESS_MODE_NAMES, Session

CSS = """
.prism-evidence { border-left: 3px solid #ddd; padding: 4px 8px; margin: 6px 0; font-family: monospace; }
.prism-evidence-source { opacity: 0.75; font-size: 0.85em; font-family: sans-serif; }
"""

# A click on a map point writes its prototype id into the prototype id box and presses Open card.
MAP_JS = """
() => {
  const hook = () => {
    const plot = document.querySelector('#prototype-map .js-plotly-plot');
    if (!plot || plot.__prismHooked || !plot.on) return;
    plot.__prismHooked = true;
    plot.on('plotly_click', (ev) => {
      const point = ev && ev.points && ev.points[0];
      if (!point || point.customdata === undefined) return;
      const box = document.querySelector('#proto-id input');
      box.value = String(point.customdata);
      box.dispatchEvent(new Event('input', {bubbles: true}));
      box.dispatchEvent(new Event('change', {bubbles: true}));
      setTimeout(() => document.querySelector('#open-card').click(), 100);
    });
  };
  new MutationObserver(hook).observe(document.body, {childList: true, subtree: true});
}
"""

INTRO = """# PRISM studio
Every token this model writes has a logit that splits **exactly** into a residual plus one slice per active
prototype — a learned direction anchored to real training text. Generate, click a token to see its slices and the
evidence behind them, then switch a prototype off and see what the model writes instead."""


def build_demo(studio: Studio, concurrency: int = 2) -> gr.Blocks:
    """The one Blocks layout; `concurrency` bounds how many generations run at once (they share the CPU)."""
    categories = studio.db.categories if studio.db is not None else []
    # the legend: the categories the browser's filter offers, then what colours only tokens
    color_map = {c: plots.category_color(c) for c in [*studio.filters(), NO_PROTOTYPE] if c != NEVER_ACTIVE}
    color_map[h.CHANGED] = "#ff2d2d"
    db_note = "" if studio.db is not None else f"\n\n⚠️ {html.escape(studio.db_error or '')} " + \
        "No precompute database: labels, categories and evidence are off. Build one with `python -m precompute " \
        "build --model MODEL --corpus CORPUS --db out.duckdb` and start with `--db out.duckdb`."
    check = studio.db.text_check if studio.db is not None else None
    if check and check["errors"]:
        db_note += (f"\n\n⚠️ {check['documents'] - check['resolved']} of {check['documents']} evidence documents "
                    f"could not be read back from the installed corpus packages, so their snippets are hidden: "
                    f"{html.escape(check['errors'][0])}")
    lim = studio.limits
    # Uploads and the files handlers return live in Gradio's cache: swept every 10 minutes, gone after file_max_age_s.
    with gr.Blocks(title="PRISM studio", delete_cache=(600, lim.file_max_age_s)) as demo:
        # an idle session's texts and interventions are dropped after session_ttl_s (launch bounds their number)
        session = gr.State(Session(), time_to_live=lim.session_ttl_s)
        gr.Markdown(INTRO + db_note)
        with gr.Row():
            with gr.Column(scale=3):
                with gr.Tabs() as tabs:
                    with gr.Tab("Generate", id="generate"):
                        with gr.Row():
                            prompt = gr.Textbox(label="Prompt", lines=3, scale=3, elem_id="prompt",
                                                value="The river flows into the", max_length=lim.max_prompt_chars,
                                                info=f"at most {lim.max_prompt_tokens} tokens")
                            with gr.Column(scale=2):
                                max_new = gr.Slider(1, lim.max_new_tokens, value=min(24, lim.max_new_tokens), step=1,
                                                    label="Max new tokens",
                                                    elem_id="max-new")
                                temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy)",
                                                        elem_id="temperature")
                                top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="Top-p", elem_id="top-p")
                                seed = gr.Number(value=0, step=1, label="Seed", elem_id="seed")
                        with gr.Row():
                            generate_btn = gr.Button("Generate", variant="primary", elem_id="generate", scale=4)
                            stop_btn = gr.Button("Stop", variant="stop", elem_id="stop", scale=1)
                        gen_status = gr.Markdown(elem_id="gen-status")
                        with gr.Row(equal_height=False):
                            with gr.Column():
                                gr.Markdown("**Original** (no interventions)", elem_id="original-title")
                                original = gr.HighlightedText(label="Original", color_map=color_map,
                                                              show_legend=True, show_label=False,
                                                              show_inline_category=False, elem_id="original")
                            with gr.Column():
                                intervened_title = gr.Markdown(h.INTERVENED_TITLE, elem_id="intervened-title")
                                intervened = gr.HighlightedText(label="Intervened", color_map=color_map,
                                                                show_legend=False, show_label=False,
                                                                show_inline_category=False, elem_id="intervened")
                        with gr.Row(elem_id="share-row"):
                            link_btn = gr.Button("Copy link", size="sm", elem_id="copy-link")
                            export_gen_btn = gr.Button("Export generation (JSON)", size="sm", elem_id="export-gen")
                            export_iv_btn = gr.Button("Export interventions (JSON)", size="sm", elem_id="export-iv")
                            import_iv_btn = gr.UploadButton("Import interventions", size="sm", file_types=[".json"],
                                                            type="filepath", elem_id="import-iv")
                        share_status = gr.Markdown(elem_id="share-status")
                        link_box = gr.Textbox(label="Link to this state", visible=False, interactive=False,
                                              buttons=["copy"], elem_id="link", max_lines=1)
                        export_file = gr.File(label="Download", interactive=False, elem_id="export-file",
                                              visible=False)
                        with gr.Row():
                            run = gr.Radio(list(h.RUNS), value="original", label="Text", scale=1)
                            index = gr.Number(value=0, step=1, label="Token index", scale=1)
                            decompose_btn = gr.Button("Explain token", scale=1, elem_id="explain")
                        token_md = gr.Markdown(elem_id="token-summary")
                        waterfall = gr.Plot(label="Decomposition", elem_id="decomposition")
                        alternatives = gr.Plot(label="Alternatives", elem_id="alternatives")
                        active = gr.Dataframe(headers=h.ACTIVE_HEADERS, label="Active prototypes (click a row)",
                                              interactive=False, elem_id="active", wrap=True,
                                              column_widths=["44px", "226px", "130px", "112px", "130px"])
                        with gr.Accordion("Training data behind this token", open=True, elem_id="attribution-panel"):
                            attribute_btn = gr.Button("Find the training data", elem_id="attribute")
                            attribution_html = gr.HTML(EMPTY_ATTRIBUTION, elem_id="attribution")
                            attribution_json = gr.JSON(visible=False)
                        with gr.Accordion("Data (as the API returns it)", open=False):
                            result_json = gr.JSON(label="generate")
                            token_json = gr.JSON(label="decompose")
                    with gr.Tab("Prototypes", id="browse"):
                        with gr.Row():
                            query_box = gr.Textbox(label="Search", placeholder="e.g. year, suffix, a hospital",
                                                   scale=3, elem_id="search-box")
                            mode = gr.Radio(["label", "semantic"], value="label", label="Search by", scale=1)
                            category = gr.Dropdown(["all", *studio.filters()], value="all", label="Category",
                                                   scale=1, elem_id="category-filter")
                            order = gr.Dropdown(list(h.ORDERINGS), value="relevance", label="Sort by", scale=1,
                                                elem_id="order")
                        with gr.Row():
                            search_btn = gr.Button("Search", variant="primary", elem_id="search", scale=3)
                            export_table_btn = gr.Button("Export all prototypes (CSV)", scale=1,
                                                         elem_id="export-table")
                        table_file = gr.File(label="Download", interactive=False, elem_id="table-file",
                                             visible=False)
                        search_status = gr.Markdown(elem_id="search-status")
                        table = gr.Dataframe(headers=h.TABLE_HEADERS, interactive=False, label="Prototypes (click a "
                                             "row)", elem_id="table", max_height=360, column_widths=h.TABLE_WIDTHS,
                                             wrap=True)
                        proto_map = gr.Plot(label="Map", elem_id="prototype-map")
            with gr.Column(scale=2):
                gr.Markdown("### Prototype")
                with gr.Row():
                    proto_id = gr.Number(label="Prototype id", step=1, elem_id="proto-id", scale=2)
                    open_btn = gr.Button("Open card", scale=1, elem_id="open-card")
                with gr.Row():
                    suppress_btn = gr.Button("Suppress", variant="stop", elem_id="suppress")
                    factor = gr.Slider(0, 5, value=2, step=0.1, label="Scale factor", elem_id="factor")
                    scale_btn = gr.Button("Scale", elem_id="scale")
                card_md = gr.Markdown(elem_id="card")
                evidence = gr.HTML(elem_id="evidence")
                with gr.Row():
                    export_ev_btn = gr.Button("Export this prototype's evidence (CSV)", size="sm",
                                              elem_id="export-evidence")
                evidence_file = gr.File(label="Download", interactive=False, elem_id="evidence-file",
                                        visible=False)
                signature = gr.Plot(label="Logit signature")
                histogram = gr.Plot(label="Activation histogram")
                card_json = gr.JSON(visible=False)
                gr.Markdown("### Your interventions")
                iv_status = gr.Markdown(elem_id="iv-status")
                iv_table = gr.Dataframe(headers=h.INTERVENTION_HEADERS, interactive=False, elem_id="interventions")
                iv_suppress_mode = gr.Radio(
                    [(name, mode) for mode, name in SUPPRESS_MODE_NAMES.items()], value=Session().suppress_mode,
                    label="A suppressed prototype is switched off by", elem_id="suppress-mode",
                    info="re-route: the nearest other prototypes take its slot and the text stays fluent; remove "
                         "the slice: its share of the state is simply missing (exact subtraction)")
                with gr.Row():
                    remove_index = gr.Number(value=0, step=1, label="#", scale=1)
                    remove_btn = gr.Button("Remove", scale=1)
                    clear_btn = gr.Button("Clear all", scale=1)
                presets = studio.presets()
                with gr.Row():
                    iv_preset = gr.Dropdown([p["title"] for p in presets], label="Preset (one click)", scale=2,
                                            value=presets[0]["title"] if presets else None, elem_id="preset",
                                            info="; ".join(f"{p['title']}: {p['n']} prototypes" for p in presets)
                                            or "this database has no presets (python -m precompute.presets)")
                    preset_btn = gr.Button("Apply preset", scale=1, elem_id="preset-apply")
                with gr.Row():
                    iv_category = gr.Dropdown(categories, label="Category", scale=2)
                    category_btn = gr.Button("Suppress category", scale=1)
                with gr.Row():
                    iv_search = gr.Textbox(label="Every prototype matching", scale=2)
                    iv_mode = gr.Radio(["label", "semantic"], value="label", label="by", scale=1)
                    iv_search_btn = gr.Button("Suppress all", scale=1)
                iv_repr = gr.Textbox(visible=False)
                with gr.Accordion("Controller", open=False, elem_id="controller-panel"):
                    gr.Markdown("A fitted controller reweights prototypes wherever they are active "
                                "(`python -m bench.controllers fit`). Load one, see what it moves, switch it on.")
                    shipped = list(app_controllers.shipped(studio))
                    ctl_shipped = gr.Dropdown(shipped, value=shipped[0] if shipped else None,
                                              label="Shipped controller", elem_id="ctl-shipped",
                                              info=None if shipped else "none shipped for this model")
                    ctl_path = gr.Textbox(label="or a controller file on the server (.safetensors)",
                                          elem_id="ctl-path", visible=lim.server_paths)
                    ctl_upload = gr.File(label="or upload one", file_types=[".safetensors"], type="filepath",
                                         elem_id="ctl-upload")
                    ctl_on = gr.Checkbox(value=True, label="Use it for the intervened text", elem_id="ctl-on")
                    ctl_btn = gr.Button("Load / apply", elem_id="ctl-apply")
                    ctl_status = gr.Markdown(elem_id="ctl-status")
                    ctl_table = gr.Dataframe(headers=h.CONTROLLER_HEADERS, interactive=False, elem_id="ctl-table",
                                             label="Most raised and lowered prototypes (click a row)")
                    ctl_json = gr.JSON(visible=False)

        card_outputs = [card_md, signature, histogram, evidence, card_json]
        iv_outputs = [session, iv_table, iv_status]
        control = gr.State(h.RunControl(), time_to_live=lim.session_ttl_s)
        # Everything that runs the model (generation, a token's decomposition, training data, exports, a restored
        # link), named or hidden, shares one concurrency group: at most `concurrency` at once, whoever calls.
        model = {"concurrency_limit": concurrency, "concurrency_id": "model"}
        generate_btn.click(
            h.clear_explanation, None, [waterfall, alternatives, token_md, active, token_json, attribution_html,
                                      attribution_json, gen_status], api_name=False, queue=False).then(
            partial(h.generate, studio), [prompt, max_new, temperature, top_p, seed, session, control],
            [original, intervened, gen_status, intervened_title, session, result_json], api_name="generate", **model)
        stop_btn.click(h.request_stop, [control], None, api_name=False, queue=False)
        token_outputs = [waterfall, alternatives, token_md, active, proto_id, session, token_json]
        decompose_btn.click(partial(h.decompose, studio), [run, index, session], token_outputs, api_name="decompose",
                            **model).then(
            partial(h.prototype, studio), [proto_id], card_outputs, api_name=False)
        for select, component in ((h.select_original, original), (h.select_intervened, intervened)):
            component.select(select, None, [run, index], api_name=False).then(
                partial(h.decompose, studio), [run, index, session], token_outputs, api_name=False, **model).then(
                partial(h.prototype, studio), [proto_id], card_outputs, api_name=False)
        open_btn.click(partial(h.prototype, studio), [proto_id], card_outputs, api_name="prototype")

        def pick_row(evt: gr.SelectData):
            return evt.row_value[0]

        for frame in (active, table):
            frame.select(pick_row, None, [proto_id], api_name=False).then(
                partial(h.prototype, studio), [proto_id], card_outputs, api_name=False)

        search_inputs = [query_box, mode, category, order]
        map_inputs = [query_box, table, card_json, category]
        search_btn.click(partial(h.search, studio), search_inputs, [table, search_status], api_name="search").then(
            partial(h.map_plot, studio), map_inputs, [proto_map], api_name=False)
        for trigger in (query_box.submit, mode.input, category.input, order.input):  # every change applies at once
            trigger(partial(h.search, studio), search_inputs, [table, search_status], api_name=False).then(
                partial(h.map_plot, studio), map_inputs, [proto_map], api_name=False)
        card_json.change(partial(h.map_plot, studio), map_inputs, [proto_map], api_name=False)

        suppress_btn.click(partial(iv.suppress, studio), [proto_id, session], iv_outputs, api_name="suppress")
        scale_btn.click(partial(iv.scale, studio), [proto_id, factor, session], iv_outputs, api_name="scale")
        category_btn.click(partial(iv.suppress_category, studio), [iv_category, session], iv_outputs,
                           api_name="suppress_category")
        iv_search_btn.click(partial(iv.suppress_search, studio), [iv_search, iv_mode, session], iv_outputs,
                            api_name="suppress_search")
        preset_btn.click(partial(iv.apply_preset, studio), [iv_preset, session], iv_outputs, api_name="preset")
        iv_suppress_mode.input(iv.suppress_mode, [iv_suppress_mode, session], iv_outputs, api_name="suppress_mode")
        remove_btn.click(iv.remove_intervention, [remove_index, session], iv_outputs, api_name="remove_intervention")
        clear_btn.click(iv.clear_interventions, [session], iv_outputs, api_name="clear_interventions")
        iv_refresh = gr.Button(visible=False)
        iv_refresh.click(iv.list_interventions, [session], [iv_table, iv_repr], api_name="interventions")
        ctl_btn.click(partial(iv.controller, studio), [ctl_path, ctl_upload, ctl_on, session, ctl_shipped],
                      [session, ctl_table, ctl_status, ctl_json], api_name="controller", **model).then(
            iv.list_interventions, [session], [iv_table, iv_repr], api_name=False)
        ctl_table.select(iv.pick_controller_row, None, [proto_id], api_name=False).then(
            partial(h.prototype, studio), [proto_id], card_outputs, api_name=False)

        # Training data behind the selected token: on request, and whenever a token's decomposition arrives.
        attribution_outputs = [attribution_html, attribution_json]
        attribute_btn.click(partial(h.attribute, studio), [run, index, session], attribution_outputs,
                            api_name="attribute", **model)
        token_json.change(partial(h.refresh_attribution, studio), [token_json, run, index, session],
                          attribution_outputs, api_name=False, **model)

        # Links, exports, imports.
        settings_inputs = [prompt, max_new, temperature, top_p, seed]
        # Gradio passes gr.Request only to functions whose own annotations name it (not through a partial).
        def link_for(prompt, max_new, temperature, top_p, seed, run, token, session, request: gr.Request):
            return h.share_link(studio, prompt, max_new, temperature, top_p, seed, run, token, session, request)

        def restore_for(session, request: gr.Request):
            return h.restore_link(studio, session, request)

        link_btn.click(link_for, [*settings_inputs, run, token_json, session],
                       [link_box, share_status], api_name="link").then(
            None, [link_box], None, api_name=False,
            js="(url) => { if (url && navigator.clipboard) navigator.clipboard.writeText(url).catch(() => {}); }").then(
            h._shown_if_set, [link_box], [link_box], api_name=False)
        export_gen_btn.click(partial(h.export_generation, studio), [session], [export_file, share_status],
                             api_name="export_generation", **model).then(
            h._shown_if_set, [export_file], [export_file], api_name=False)
        export_iv_btn.click(partial(h.export_interventions, studio), [session], [export_file, share_status],
                            api_name="export_interventions").then(
            h._shown_if_set, [export_file], [export_file], api_name=False)
        import_iv_btn.upload(partial(h.import_interventions, studio), [import_iv_btn, session],
                             [session, iv_table, iv_status, iv_suppress_mode], api_name="import_interventions")
        export_table_btn.click(partial(h.export_table, studio), None, [table_file, search_status],
                               api_name="export_table").then(
            h._shown_if_set, [table_file], [table_file], api_name=False)
        export_ev_btn.click(partial(h.export_evidence, studio), [proto_id], [evidence_file, iv_status],
                            api_name="export_evidence").then(
            h._shown_if_set, [evidence_file], [evidence_file], api_name=False)
        pending = gr.State(None, time_to_live=lim.session_ttl_s)
        demo.load(restore_for, [session],
                  [*settings_inputs, session, iv_table, iv_status, iv_suppress_mode, pending, gen_status],
                  api_name=False).then(
            partial(h.generate_pending, studio), [pending, *settings_inputs, session],
            [original, intervened, gen_status, intervened_title, session, result_json], api_name=False, **model).then(
            partial(h.select_pending, studio), [pending, session], [run, index, *token_outputs, *card_outputs],
            api_name=False, **model)

        demo.load(partial(h.search, studio), search_inputs, [table, search_status], api_name=False).then(
            partial(h.map_plot, studio), map_inputs, [proto_map], api_name="map")
        demo.load(h.deep_link, None, [proto_id, tabs], api_name=False).then(
            partial(h.prototype, studio), [proto_id], card_outputs, api_name=False)
    return demo


def launch(demo: gr.Blocks, host: str | None = None, port: int | None = None, share: bool = False,
           concurrency: int = 2, block: bool = True, limits: Limits | None = None):
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
    return demo.launch(server_name=host, server_port=port, share=share, prevent_thread_lock=not block,
                       css=CSS, js=MAP_JS, theme=gr.themes.Soft(), footer_links=["api"], quiet=True,
                       show_error=False, max_file_size=limits.max_upload_bytes,
                       state_session_capacity=limits.max_sessions,
                       app_kwargs={"middleware": [Middleware(RequestLimiter, limits=limits, pending=pending)]})
