"""`python app.py --mcp` serves the agents' tools (app/tools.py) through Gradio's own MCP server: a real MCP client
(the `mcp` SDK over streamable HTTP) lists exactly those tools, with their documented arguments, and every call
answers with the numbers the library computes in this process on the same model and database."""

from __future__ import annotations

import ast
import asyncio

import pytest
from test_app_support import build_tiny_attribution_db, changing_prototype, running_app, shared_assets

from app.attribution import attribute_token
from app.core import GenerationSettings, Studio
from app.tools import TOOLS
from prism import Interventions
from prism.explain import contrast_tokens

pytestmark = pytest.mark.slow
PROMPT = "the cat sat on the"


def mcp_calls(url: str, calls: list[tuple[str, dict]]) -> tuple[list, list]:
    """(the tools the server lists, each call's (is_error, answer)) over one MCP session."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async def run():
        async with streamablehttp_client(url + "/gradio_api/mcp/") as (read, write, _), \
                ClientSession(read, write) as session:
            await session.initialize()
            listed = (await session.list_tools()).tools
            answers = []
            for name, arguments in calls:
                result = await session.call_tool(name, arguments)
                text = result.content[0].text if result.content else ""
                answers.append((result.isError, text if result.isError else ast.literal_eval(text)))
            return listed, answers

    return asyncio.run(run())


def test_every_tool_answers_through_a_real_mcp_client_with_the_librarys_numbers(tmp_path_factory):
    model, db = shared_assets(tmp_path_factory)
    db = build_tiny_attribution_db(tmp_path_factory.getbasetemp() / "app_assets", model, db)
    studio = Studio.load(model, db)
    settings = GenerationSettings(PROMPT, max_new_tokens=6)
    pid = changing_prototype(studio, settings, "reroute")
    calls = [("generate_explained", {"prompt": PROMPT, "max_new_tokens": 6, "suppress": [pid]}),
             ("explain_token", {"prompt": PROMPT, "index": 2, "max_new_tokens": 6}),
             ("search_prototypes", {"query": studio.label(3)[0], "mode": "label", "k": 5}),
             ("prototype_card", {"prototype_id": 3, "n_evidence": 2}),
             ("compare_interventions", {"prompt": PROMPT, "suppress": [pid], "max_new_tokens": 6}),
             ("training_data", {"prompt": PROMPT, "index": 1, "max_new_tokens": 6, "top": 4}),
             ("explain_token", {"prompt": PROMPT, "index": 99, "max_new_tokens": 3})]
    with running_app(model, db, extra=("--mcp",)) as url:
        listed, answers = mcp_calls(url, calls)

    assert sorted(t.name for t in listed) == sorted(TOOLS)  # the page's own events are not tools
    for tool in listed:
        assert len(tool.description) > 80 and tool.inputSchema["properties"], tool.name
        assert all(p.get("description") for p in tool.inputSchema["properties"].values()), tool.name
    assert not any(error for error, _ in answers[:-1]), [a for e, a in answers if e]
    generated, explained, found, card, compared, training, _ = (a for _, a in answers)

    original = studio.generate(settings)
    intervened = studio.generate(settings, Interventions(suppress={pid}, suppress_mode="reroute"))
    assert [t["token_id"] for t in generated["original"]["tokens"]] == original.token_ids
    assert [t["token_id"] for t in generated["intervened"]["tokens"]] == intervened.token_ids

    view = studio.explain(original, 2)
    chosen = explained["chosen"]
    assert chosen["token_id"] == view.chosen.token_id
    assert chosen["logit"] == pytest.approx(view.chosen.logit, abs=1e-4)
    assert chosen["residual"] == pytest.approx(view.chosen.residual, abs=1e-4)
    parts = chosen["residual"] + sum(s["contribution"] for s in chosen["slices"]) + \
        chosen["other_slices"]["contribution"]
    assert parts == pytest.approx(chosen["logit"], abs=1e-4)
    assert explained["carried"]["prototypes"] == pytest.approx(view.carried.prototypes, abs=1e-4)
    runner = view.alternatives[1]
    contrast = contrast_tokens(studio.model, studio.state(original, 2), view.chosen.token_id, runner.token_id,
                               original.interventions)
    assert explained["contrast"]["margin"] == pytest.approx(contrast.margin, abs=1e-4)
    assert explained["contrast"]["prototypes"] == pytest.approx(contrast.prototypes, abs=1e-4)

    expected = studio.need_db().search(studio.label(3)[0], "label", 5)
    assert [r["prototype_id"] for r in found] == [r["prototype_id"] for r in expected]
    assert card["prototype_id"] == 3 and card["label"] == studio.label(3)[0] and len(card["evidence"]) == 2
    assert (compared["original"], compared["intervened"]) == (original.text, intervened.text)

    library = attribute_token(studio, original, 1, top=4)
    assert [r["score"] for r in training["sequences"]] == pytest.approx([r["score"] for r in library["sequences"]])

    error, message = answers[-1]
    assert error and "no generated token 99" in message  # a refusal is the tool's error, with its message
