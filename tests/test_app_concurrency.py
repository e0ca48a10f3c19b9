"""Eight gradio_client sessions with different interventions at once against a running app.py: no errors, and
every session sees exactly its own interventions (and its own way of suppressing: half of them switch from the
app's default re-routing to removing the slices) and the text model.generate writes with them."""

from __future__ import annotations

import threading

import pytest
from test_app_support import running_app, shared_assets

from app.core import GenerationSettings, Studio
from app.session import DEFAULT_SUPPRESS_MODE
from prism import Interventions

pytestmark = pytest.mark.slow  # servers and browsers: not in the fast tier

N_USERS = 8
PROMPT = "the cat sat on the"
TOKENS = 6


def user_plan(n: int) -> tuple[list[tuple[str, tuple]], Interventions]:
    """Different interventions per user: suppress one or two prototypes, or scale one; odd users remove the
    slices instead of re-routing."""
    mode = "zero" if n % 2 else DEFAULT_SUPPRESS_MODE
    switch = [("/suppress_mode", (mode,))] if mode != DEFAULT_SUPPRESS_MODE else []
    if n % 3 == 0:
        return switch + [("/suppress", (n,))], Interventions(suppress={n}, suppress_mode=mode)
    if n % 3 == 1:
        return switch + [("/suppress", (n,)), ("/suppress", (n + 8,))], \
            Interventions(suppress={n, n + 8}, suppress_mode=mode)
    return switch + [("/scale", (n, 3.0))], Interventions(scale={n: 3.0}, suppress_mode=mode)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shared_assets(tmp_path_factory)


def test_eight_sessions_do_not_see_each_other(assets):
    gradio_client = pytest.importorskip("gradio_client")
    model, db = assets
    studio = Studio.load(model, db)
    settings = GenerationSettings(PROMPT, max_new_tokens=TOKENS)
    expected = {n: studio.generate(settings, user_plan(n)[1]).token_ids for n in range(N_USERS)}
    original = studio.generate(settings).token_ids
    results, errors = {}, []
    barrier = threading.Barrier(N_USERS)

    def user(n: int, url: str) -> None:
        try:
            client = gradio_client.Client(url, verbose=False)
            calls, interventions = user_plan(n)
            barrier.wait(timeout=60)
            for api_name, args in calls:
                client.predict(*args, api_name=api_name)
            _, _, status, _, result = client.predict(PROMPT, TOKENS, 0, 1, 0, api_name="/generate")
            rows, described = client.predict(api_name="/interventions")
            token = client.predict("intervened", 0, api_name="/decompose")
            results[n] = (result, rows, described, token, interventions)
        except Exception as err:  # noqa: BLE001 - reported below with the user's number
            errors.append(f"user {n}: {type(err).__name__}: {err}")

    with running_app(model, db, concurrency=4) as url:
        threads = [threading.Thread(target=user, args=(n, url)) for n in range(N_USERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    assert not errors, errors
    assert len(results) == N_USERS
    for n, (result, rows, described, token, interventions) in results.items():
        assert all(f"{p}" in described for p in interventions.suppress), (n, described)
        got = result["intervened"]["interventions"]
        assert set(got["suppress"]) == set(interventions.suppress), (n, got)
        assert got["suppress_mode"] == interventions.suppress_mode, (n, got)
        assert {int(k): v for k, v in got["scale"].items()} == interventions.scale, (n, got)
        assert [t["token_id"] for t in result["intervened"]["tokens"]] == expected[n], n
        assert [t["token_id"] for t in result["original"]["tokens"]] == original, n
        assert len(rows["data"]) == len([c for c in user_plan(n)[0] if c[0] != "/suppress_mode"]), (n, rows)
        assert sorted(interventions.suppress) == sorted(
            int(p) for row in rows["data"] for p in str(row[2]).split(", ") if row[1].startswith("suppress"))
        chosen = token[5]["chosen"]
        assert chosen["token_id"] == expected[n][0]
        assert abs(chosen["sum"] - chosen["logit"]) <= 1e-4 * max(1, abs(chosen["logit"]))
