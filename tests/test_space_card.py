"""The Space's card (space/README.md) as the Hub reads it: huggingface_hub's own parser accepts its metadata, the
fields the Spaces configuration reference documents have their documented values, and the card links the paper
and says how an API or MCP client connects, naming exactly the tools the app serves."""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import SpaceCard

from app.tools import TOOLS

ROOT = Path(__file__).resolve().parent.parent
CARD = ROOT / "space" / "README.md"
COLORS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}  # the reference's colour names
SDKS = {"gradio", "docker", "static"}
KNOWN = {"title", "emoji", "colorFrom", "colorTo", "sdk", "sdk_version", "python_version", "app_file", "app_port",
         "base_path", "fullWidth", "header", "short_description", "models", "datasets", "tags", "thumbnail",
         "pinned", "license", "suggested_hardware", "suggested_storage", "startup_duration_timeout",
         "custom_headers", "preload_from_hub", "disable_embedding", "hf_oauth", "duplicated_from"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def test_the_space_card_has_the_documented_fields_and_values():
    card = SpaceCard.load(CARD)
    data = card.data.to_dict()
    assert set(data) <= KNOWN, set(data) - KNOWN
    assert data["sdk"] in SDKS and data["colorFrom"] in COLORS and data["colorTo"] in COLORS
    if data["sdk"] == "docker":  # a Docker Space says which port its app listens on, and the Dockerfile agrees
        assert isinstance(data["app_port"], int)
        assert f"EXPOSE {data['app_port']}" in (ROOT / "Dockerfile").read_text()
    assert 0 < len(data["short_description"]) <= 60
    assert data["license"] == "apache-2.0"
    assert data["models"] and all(HUB_ID.match(m) for m in data["models"])
    assert all(isinstance(t, str) and t for t in data.get("tags", []))
    assert len(data["emoji"]) == 1


def test_the_space_card_links_the_paper_and_names_the_tools():
    text = SpaceCard.load(CARD).text
    assert "https://arxiv.org/abs/2607.00510" in text
    assert "/gradio_api/mcp/" in text
    named = set(re.findall(r"`(\w+)`", text))
    assert set(TOOLS) <= named
    calls = re.findall(r'api_name="/(\w+)"', text)
    assert calls and set(calls) <= set(TOOLS)
    assert "residual" in text  # it says how much the explanation explains, not only that it is exact
