"""The app's controller panel (app/controllers.py, the `controller` handler and endpoint): loading a fitted
prototype controller into one session, its description with labels and evidence, the intervened text it gives
(equal to model.generate with the same Interventions), why a token changed, and other sessions left alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_app_support import build_tiny_controller, running_app, shared_assets

from app import controllers as app_controllers
from app import handlers, interventions
from app.core import AppError, GenerationSettings, Studio
from app.session import Session
from bench.dense_controller import DenseController, make_frame
from prism import Interventions
from prism.controllers import PrototypeController, save_controller

PROMPT = "the cat sat on the"
TOKENS = 8


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one thread, so a busy machine's other jobs do not make every op wait for a second one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shared_assets(tmp_path_factory)


@pytest.fixture(scope="module")
def studio(assets):
    model, db = assets
    return Studio.load(model, db)


@pytest.fixture(scope="module")
def controller_file(studio, tmp_path_factory):
    return build_tiny_controller(studio, tmp_path_factory.mktemp("app_controllers"), PROMPT, TOKENS)


def test_load_and_describe_with_labels_and_evidence(studio, controller_file):
    path, controller = controller_file
    loaded = app_controllers.load(studio, str(path))
    torch.testing.assert_close(loaded.log_factors, controller.log_factors)
    view = app_controllers.describe(studio, loaded, n=5)
    assert view["moved"] == 4 and view["task"] == "next_sentence"
    assert [r["prototype_id"] for r in view["raised"]] == [r["prototype_id"] for r in controller.top(5)["raised"]]
    assert len(view["raised"]) == 2 and len(view["lowered"]) == 2
    for row in view["raised"] + view["lowered"]:
        assert (row["label"], row["category"]) == studio.label(row["prototype_id"])
    assert any("[" in row["evidence"] for row in view["raised"] + view["lowered"])  # the evidence token is marked
    assert all(r["factor"] > 1 for r in view["raised"]) and all(r["factor"] < 1 for r in view["lowered"])
    rows = app_controllers.table_rows(view)
    assert [r[0] for r in rows] == ["raised", "raised", "lowered", "lowered"]


def test_bad_controller_files_get_a_message(studio, controller_file, tmp_path):
    with pytest.raises(AppError, match="path"):
        app_controllers.load(studio, "  ")
    with pytest.raises(AppError, match=".safetensors"):
        app_controllers.load(studio, str(tmp_path / "c.json"))
    with pytest.raises(AppError, match="no controller file"):
        app_controllers.load(studio, str(tmp_path / "missing.safetensors"))
    other = save_controller(PrototypeController(torch.zeros(8)), tmp_path / "k8.safetensors")
    with pytest.raises(AppError, match="8 prototypes"):
        app_controllers.load(studio, str(other))
    n, d = studio.n_prototypes, studio.model.d_model
    dense = save_controller(DenseController(make_frame(n, d, 0), torch.zeros(n)), tmp_path / "dense.safetensors")
    with pytest.raises(AppError, match="dense baseline"):
        app_controllers.load(studio, str(dense))


def test_handler_switches_the_controller_on_for_this_session_only(studio, controller_file):
    path, controller = controller_file
    session, rows, status, view = interventions.controller(studio, str(path), None, True, Session())
    assert "⚠️" not in status and session.controller_on and len(rows) == 4 and view["moved"] == 4
    assert session.interventions().controller is session.controller
    settings = GenerationSettings(PROMPT, max_new_tokens=TOKENS)
    expected = studio.generate(settings, Interventions(controller=controller)).token_ids
    *_, session, result = list(handlers.generate(studio, PROMPT, TOKENS, 0, 1, 0, session))[-1]
    assert [t["token_id"] for t in result["intervened"]["tokens"]] == expected
    assert result["first_change"] is not None and result["intervened"]["interventions"]["controller"]
    assert session.controller is not None  # generation keeps the loaded controller
    # the changed token: why_changed names controller-moved prototypes, and their effects add up
    why = studio.why_changed(session.original, session.intervened, result["first_change"])
    assert why.effects and {e["prototype_id"] for e in why.effects} <= set(controller.moved())
    # off again: the same loaded controller, no effect on this session's interventions
    off, _, status, _ = interventions.controller(studio, "", None, False, session)
    assert off.controller is session.controller and off.interventions().is_empty and "off" in status
    assert Session().interventions().is_empty  # a fresh session never sees it
    _, rows, status, view = interventions.controller(studio, "", None, True, Session())
    assert status.startswith("⚠️") and rows == [] and view is None
    _, _, status, _ = interventions.controller(studio, "nope.txt", None, True, replace(session, controller_on=False))
    assert status.startswith("⚠️")


@pytest.mark.slow
def test_controller_endpoint_over_http(assets, controller_file):
    gradio_client = pytest.importorskip("gradio_client")
    model, db = assets
    path, controller = controller_file
    studio = Studio.load(model, db)
    expected = studio.generate(GenerationSettings(PROMPT, max_new_tokens=TOKENS),
                               Interventions(controller=controller)).token_ids
    with running_app(model, db) as url:
        client = gradio_client.Client(url, verbose=False)
        rows, status, view = client.predict(str(path), None, True, api_name="/controller")
        assert "⚠️" not in status and view["moved"] == 4 and len(rows["data"]) == 4
        *_, result = client.predict(PROMPT, TOKENS, 0, 1, 0, api_name="/generate")
        assert [t["token_id"] for t in result["intervened"]["tokens"]] == expected
        other = gradio_client.Client(url, verbose=False)  # another session: no controller
        *_, plain = other.predict(PROMPT, TOKENS, 0, 1, 0, api_name="/generate")
        assert plain["intervened"] is None
