"""The README's pictures, made by driving the real app in Chromium, so they can be refreshed after any UI change:

    python -m tools.screenshots                       # the shipped default -> docs/images/*.png
    python -m tools.screenshots --width 1280 --theme dark --out test-artifacts/dark

It starts the app on a free 127.0.0.1 port, follows the README walkthrough (its prompt, temperature and seed are
read from README.md) and writes:

    top.png             the page as it first shows at 1280x800 after Generate: the texts above the fold
    decomposition.png   a token of the original text explained: summary, waterfall, alternatives
    side-by-side.png    the walkthrough's preset switched on: the two texts, the changed tokens marked
    card.png            the top prototype's card with its evidence
    map.png             the Prototypes tab: the table and the map

Needs Debian's chromium (apt-get install -y chromium) and Playwright (requirements.txt).
"""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path

from app.assets import ROOT, resolve_db, resolve_model
from prism import cli

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]
TIMEOUT_MS = 300_000
logger = logging.getLogger("tools.screenshots")


def walkthrough(readme: Path = ROOT / "README.md") -> dict:
    """Prompt, temperature and seed of the README walkthrough's first step."""
    text = readme.read_text()
    found = re.search(r"type `([^`]+)` as the prompt, Temperature ([\d.]+), Seed (\d+)", text)
    if not found:
        raise SystemExit("README.md has no walkthrough step naming the prompt, Temperature and Seed")
    return {"prompt": found.group(1), "temperature": float(found.group(2)), "seed": int(found.group(3))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_number(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input[type='number']").first
    box.fill(str(value))
    box.press("Tab")


def _generate(page, done: str) -> None:
    """Press Generate and wait until the status line says `done` (what only this run's end writes)."""
    page.click("#generate")
    page.wait_for_function("(d) => document.querySelector('#gen-status').innerText.includes(d)", arg=done)


def _shot(page, out: Path, name: str, selectors: list[str], pad: int = 8) -> Path:
    """One picture of the area the selectors' elements cover together."""
    page.locator(selectors[0]).first.scroll_into_view_if_needed()
    sx, sy = page.evaluate("[window.scrollX, window.scrollY]")  # bounding boxes are relative to the viewport
    boxes = [page.locator(s).first.bounding_box() for s in selectors]
    boxes = [{**b, "x": b["x"] + sx, "y": b["y"] + sy} for b in boxes if b]
    x0, y0 = min(b["x"] for b in boxes) - pad, min(b["y"] for b in boxes) - pad
    x1 = max(b["x"] + b["width"] for b in boxes) + pad
    y1 = max(b["y"] + b["height"] for b in boxes) + pad
    path = out / f"{name}.png"
    page.screenshot(path=str(path), full_page=True,
                    clip={"x": max(0, x0), "y": max(0, y0), "width": x1 - max(0, x0), "height": y1 - max(0, y0)})
    logger.info("wrote %s", path)
    return path


def take(url: str, out: Path, width: int = 1400, theme: str = "light") -> list[Path]:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    steps = walkthrough()
    written = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": width, "height": 1000}, device_scale_factor=1)
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(url + ("/?__theme=dark" if theme == "dark" else "/?__theme=light"))
        page.wait_for_selector("#prompt textarea")
        page.fill("#prompt textarea", steps["prompt"])
        _set_number(page, "temperature", steps["temperature"])
        _set_number(page, "seed", steps["seed"])
        _generate(page, "original token(s).")
        page.set_viewport_size({"width": 1280, "height": 800})  # a projector's screen: the texts above the fold
        page.evaluate("window.scrollTo(0, 0)")
        page.wait_for_timeout(500)
        top = out / "top.png"
        page.screenshot(path=str(top))
        written.append(top)
        page.set_viewport_size({"width": width, "height": 1000})
        page.locator("#original .textfield .token").nth(1).click()
        page.wait_for_function("document.querySelector('#token-summary').innerText.includes('Token 1')")
        page.wait_for_selector("#alternatives .js-plotly-plot")
        page.wait_for_timeout(1500)  # plotly's transition
        written.append(_shot(page, out, "decomposition", ["#token-summary", "#decomposition", "#alternatives"]))
        page.wait_for_function("document.querySelector('#card').innerText.includes('label score')")
        page.wait_for_selector("#evidence .prism-evidence")
        written.append(_shot(page, out, "card", ["#card", "#evidence"]))

        page.click("#preset-apply")
        page.wait_for_function("document.querySelector('#iv-status').innerText.includes('added')")
        _generate(page, "intervened token(s).")
        written.append(_shot(page, out, "side-by-side", ["#gen-status", "#original", "#intervened",
                                                          "#intervened-title"]))

        page.get_by_role("tab", name="Prototypes").click()
        # SVG points, or a WebGL canvas for a bank over 4,000 prototypes (app/plots.py)
        page.wait_for_selector("#prototype-map .js-plotly-plot .point, "
                               "#prototype-map .js-plotly-plot canvas.gl-canvas-context")
        page.wait_for_timeout(1500)
        written.append(_shot(page, out, "map", ["#prototype-map"]))
        browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("python -m tools.screenshots", __doc__)
    parser.add_argument("--model", default=None, help="a PRISM model folder (default: the shipped one)")
    parser.add_argument("--db", default=None, help="its database (default: the shipped one with the shipped model)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "images"), help="folder for the PNG files")
    parser.add_argument("--width", type=int, default=1400, help="browser window width in pixels")
    parser.add_argument("--theme", choices=["light", "dark"], default="light", help="Gradio theme mode")
    args = cli.parse(parser, argv)
    if not Path(CHROMIUM).is_file():
        cli.fail(parser, f"{CHROMIUM} is missing: apt-get install -y chromium")
    from app.core import Studio
    from app.ui import build_demo, launch

    model = resolve_model(args.model)
    studio = Studio.load(model, resolve_db(args.db, model_given=args.model is not None))
    demo = build_demo(studio)
    port = _free_port()
    launch(demo, port=port, block=False)
    try:
        take(f"http://127.0.0.1:{port}", Path(args.out), args.width, args.theme)
    finally:
        demo.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
