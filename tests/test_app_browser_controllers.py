"""Playwright drives Debian's chromium against a running app.py: open the controller panel, load a fitted controller
by path and by upload, read what it raises and lowers (labels, evidence), switch it on, generate and see the
intervened text change, click a moved prototype to open its card. Screenshots go to test-artifacts/. Needs
`apt-get install -y chromium`; without it this FAILS (as tests/test_app_browser.py does).
"""

from __future__ import annotations

import re

import pytest
import torch
from test_app_support import ROOT, build_tiny_controller, running_app, shared_assets

from app.core import Studio

pytestmark = pytest.mark.slow  # servers and browsers: not in the fast tier

ARTIFACTS = ROOT / "test-artifacts"
PROMPT = "the cat sat on the"
TOKENS = 8
TIMEOUT = 60_000


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    model, db = shared_assets(tmp_path_factory)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    studio = Studio.load(model, db)
    path, controller = build_tiny_controller(studio, tmp_path_factory.mktemp("browser_controllers"), PROMPT, TOKENS)
    torch.set_num_threads(before)
    ARTIFACTS.mkdir(exist_ok=True)
    with running_app(model, db) as url:
        yield {"url": url, "path": path, "controller": controller, "studio": studio}


def directions(table_text: str) -> list[str]:
    """The direction column of the controller table, read from its text."""
    return re.findall(r"^(raised|lowered)$", table_text, flags=re.M)


def open_panel(browser, url: str):
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    page.set_default_timeout(TIMEOUT)
    page.goto(url)
    page.wait_for_selector("#proto-id")
    page.locator("#controller-panel").get_by_text("Controller").first.click()  # the accordion opens
    page.wait_for_selector("#ctl-path textarea, #ctl-path input", state="visible")
    return page


def test_load_by_path_switch_on_generate_and_open_a_moved_prototype(browser, app):
    page = open_panel(browser, app["url"])
    page.fill("#ctl-path textarea, #ctl-path input", str(app["path"]))
    page.click("#ctl-apply")
    page.wait_for_function("document.querySelector('#ctl-status').innerText.includes('controller')")
    status = page.inner_text("#ctl-status")
    assert "⚠️" not in status and "4 prototypes moved" in status and "on" in status, status
    table = page.inner_text("#ctl-table")
    assert directions(table) == ["raised", "raised", "lowered", "lowered"], table
    studio, controller = app["studio"], app["controller"]
    top = controller.top(1)["raised"][0]["prototype_id"]
    assert studio.label(top)[0] in table
    page.screenshot(path=str(ARTIFACTS / "app-controller-1-loaded.png"), full_page=True)

    page.fill("#prompt textarea", PROMPT)
    page.locator("input[aria-label='number input for Max new tokens']").fill(str(TOKENS))
    page.locator("input[aria-label='number input for Max new tokens']").press("Tab")
    page.click("#generate")
    page.wait_for_function(f"document.querySelectorAll('#intervened .textfield .token').length == {TOKENS}")
    page.wait_for_function("document.querySelector('#gen-status').innerText.includes('changed')")
    assert page.locator("#intervened .textfield .token[style*='rgba(255, 45, 45']").count() >= 1
    page.screenshot(path=str(ARTIFACTS / "app-controller-2-generated.png"), full_page=True)

    page.locator("#ctl-table [data-testid='cell-0-1']").click()  # the most raised prototype's row
    page.wait_for_function(f"document.querySelector('#card').innerText.includes('#{top}')")
    page.screenshot(path=str(ARTIFACTS / "app-controller-3-card.png"), full_page=True)
    page.close()


def test_upload_and_refusals(browser, app):
    page = open_panel(browser, app["url"])
    page.locator("#ctl-upload input[type='file']").set_input_files(str(app["path"]))
    page.wait_for_timeout(500)
    page.click("#ctl-apply")
    page.wait_for_function("document.querySelector('#ctl-status').innerText.includes('prototypes moved')")
    assert directions(page.inner_text("#ctl-table")) == ["raised", "raised", "lowered", "lowered"]
    page.close()

    page = open_panel(browser, app["url"])
    page.fill("#ctl-path textarea, #ctl-path input", "/etc/passwd")
    page.click("#ctl-apply")
    page.wait_for_function("document.querySelector('#ctl-status').innerText.includes('⚠️')")
    assert ".safetensors" in page.inner_text("#ctl-status")
    page.close()
