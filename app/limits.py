"""What one user may cost a public app: prompt and output length, interventions, uploads, request rate, and how
long a session's state is kept. The defaults suit a CPU Space (2 cores shared by everyone on the page); app.py
sets them from its flags.

    limits = Limits(max_prompt_tokens=512)
    number("temperature", raw, 0, 2)          # a finite float in range, or AppError with a short message
    launch(..., limits=limits)                # app/ui.py: the rate limit wraps the server, the rest the handlers

The request limit works in front of Gradio's queue (RequestLimiter, an ASGI middleware): each browser session
(Gradio's session hash) gets a token bucket and a cap on events waiting or running at once, so a flooding session
is refused with HTTP 429 and a message instead of filling the queue that everyone shares. New sessions are limited
per client address, and a new session never pushes an active one out of Gradio's session store.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields

from app.errors import AppError

SPACE_ENV = "SPACE_ID"  # set by Hugging Face Spaces in every Space's environment


def on_space() -> bool:
    return bool(os.environ.get(SPACE_ENV))


@dataclass(frozen=True)
class Limits:
    # A prompt's forward pass grows with its length: 512 tokens + 256 new keeps one generation near a second of
    # CPU per token batch; the model's own context (8k) would cost minutes and ~1 GB.
    max_prompt_tokens: int = 512
    max_new_tokens: int = 256  # the page's slider goes this far
    max_interventions: int = 32  # rows of one session's list (a category, search or preset is one row)
    max_upload_bytes: int = 1_000_000  # a controller file is a few KB (K floats), an interventions file less
    file_max_age_s: int = 3600  # uploads and exports older than this are deleted (swept every 10 minutes)
    requests_per_s: float = 3.0  # per session, sustained; one token click is about 5 events (decompose, card, ...)
    burst: int = 60  # per session: a page load is about 8 events, a quick series of clicks a few dozen
    max_pending: int = 8  # per session: events waiting or running at once
    # per session: model events (generation, decomposition, training data) waiting or running at once. The page
    # never needs more than two (a generation and a click's explanation), and the queue serves each concurrency
    # group first come, first served, so this is what bounds another user's wait behind a flood.
    max_pending_model: int = 2
    session_ttl_s: int = 1800  # an idle session's state (texts, interventions) is dropped after this
    max_sessions: int = 1000  # sessions whose state is kept at once (the least recently used go first)
    # A session that sent a request this recently is active: a new session never pushes it out of the store. When
    # max_sessions sessions are all active, new pages are refused with a message until one goes quiet.
    active_session_s: int = 600
    # New sessions per client address: a page load makes one, so a visitor opening pages now and then never meets
    # this, while minting fresh session hashes to push others' sessions out of the store is held to this rate.
    new_sessions_per_minute: float = 20.0
    new_sessions_burst: int = 20
    # Admission by cost: a generation costs about columns x (new tokens + prompt tokens / 16) token steps (the
    # prompt's prefill is cheap per token, each new token is one forward); one unit is a 24-token continuation of a
    # short prompt. A session may spend cost_per_minute units a minute, cost_burst at once: a normal visitor never
    # notices, a stream of 512-token prompts with 256 new tokens in two columns (about 24 units each) is held to
    # about half of one model worker.
    cost_per_minute: float = 30.0
    cost_burst: float = 60.0
    # Proxies in front of the app that append the client's address to X-Forwarded-For (a Space has one): the
    # client is that many entries from the right; entries further left are whatever the client sent.
    trusted_proxies: int = 1
    # Hidden states of a generation are kept for fast clicks while the text is short: (T, d) floats, 576 x 4 bytes
    # per token for SmolLM2; longer texts recompute them on each click (one forward pass).
    keep_states_tokens: int = 256
    server_paths: bool = True  # the controller box may name a file on the server (never on a Space)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{f.name} must be a positive number, got {value!r}")

    HELP = {"max_prompt_tokens": "longest prompt, in tokens", "max_new_tokens": "most tokens one generation writes",
            "max_interventions": "rows in one session's intervention list",
            "max_upload_bytes": "largest upload (a controller or interventions file)",
            "file_max_age_s": "uploads and exports are deleted after this many seconds",
            "requests_per_s": "requests one session may send per second, sustained",
            "burst": "requests one session may send at once", "max_pending": "events of one session queued at once",
            "max_pending_model": "model events (generate, explain, training data) of one session queued at once",
            "session_ttl_s": "an idle session's state is dropped after this many seconds",
            "max_sessions": "sessions whose state is kept at once",
            "active_session_s": "a session heard from this recently is never pushed out by a new one",
            "new_sessions_per_minute": "new sessions one client address may open per minute, sustained",
            "new_sessions_burst": "new sessions one client address may open at once",
            "trusted_proxies": "proxies that append to X-Forwarded-For in front of the app (on a Space)",
            "cost_per_minute": "generation cost one session may spend per minute (1 = a 24-token continuation)",
            "cost_burst": "generation cost one session may spend at once",
            "keep_states_tokens": "hidden states are kept for texts up to this many tokens (else recomputed)",
            "server_paths": "the controller box may name a file on the server"}

    @property
    def max_prompt_chars(self) -> int:
        """Characters read before tokenising: a token is rarely more than 16 characters of text."""
        return self.max_prompt_tokens * 16

    @classmethod
    def for_space(cls, **overrides) -> Limits:
        return cls(**{"server_paths": False, **overrides})


# ----------------------------------------------------------------------------------------------------------------
# Numbers from the page or the API: finite, in range, or a short message.


def shown(value, max_chars: int = 40) -> str:
    """A user's input as a message quotes it: its repr, cut to max_chars (a 60k-character input is not echoed)."""
    text = repr(value) if isinstance(value, str) else repr(str(value)) if value is not None else "nothing"
    return text if len(text) <= max_chars else text[: max_chars - 2] + "…'"


def number(name: str, value, low: float, high: float, default: float | None = None) -> float:
    """value as a finite float in [low, high]; None or "" reads as `default` when one is given."""
    if value is None or (isinstance(value, str) and not value.strip()):
        if default is None:
            raise AppError(f"{name} is missing")
        return float(default)
    if isinstance(value, bool):
        raise AppError(f"{name} must be a number, got {shown(value)}")
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        raise AppError(f"{name} must be a number, got {shown(value)}") from None
    if not math.isfinite(x):
        raise AppError(f"{name} must be a finite number, got {x}")
    if not low <= x <= high:
        raise AppError(f"{name} must be between {low:g} and {high:g}, got {x:g}")
    return x


def whole(name: str, value, low: int, high: int, default: int | None = None) -> int:
    """value as an int in [low, high] (a float must be whole)."""
    x = number(name, value, low, high, default)
    if x != int(x):
        raise AppError(f"{name} must be a whole number, got {x:g}")
    return int(x)


def text(name: str, value, max_chars: int) -> str:
    """value as text of at most max_chars characters that encodes as UTF-8 (no lone surrogates)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise AppError(f"{name} must be text")
    if len(value) > max_chars:
        raise AppError(f"{name} has {len(value):,} characters; this app takes at most {max_chars:,}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise AppError(f"{name} contains characters that are not valid text (unpaired surrogates)") from None
    return value


# ----------------------------------------------------------------------------------------------------------------
# Admission by cost.

NORMAL_STEPS = 24 + 8 / 16  # one unit: a 24-token continuation of an 8-token prompt, one column


def generation_cost(prompt_tokens: int, new_tokens: int, columns: int) -> float:
    """A generation's cost in units (Limits.cost_per_minute): columns x (new tokens + prompt tokens / 16)."""
    return columns * (new_tokens + prompt_tokens / 16) / NORMAL_STEPS


class CostBudget:
    """Per session, a bucket of cost units (Limits.cost_burst, refilled at cost_per_minute): spend() admits a
    generation or says how long to wait. A SessionBuckets whose tokens are cost units; thread-safe."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.buckets = SessionBuckets(limits.cost_per_minute / 60, limits.cost_burst, 4 * limits.max_sessions, clock)

    def spend(self, key: str, cost: float) -> float:
        """Take `cost` units: 0.0 when admitted, else the seconds until the bucket holds them (nothing taken). A
        generation dearer than the whole burst is admitted when the bucket is full, and empties it."""
        return self.buckets.take(key, min(cost, self.buckets.burst))


# ----------------------------------------------------------------------------------------------------------------
# The request limit in front of the queue.


class SessionBuckets:
    """A token bucket per key (refill `rate` per second up to `burst`), for at most `max_keys` keys (the least
    recently seen are forgotten). Thread-safe."""

    def __init__(self, rate: float, burst: int, max_keys: int = 20_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.max_keys, self.clock = float(rate), float(burst), max_keys, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, last time)
        self._lock = threading.Lock()

    def take(self, key: str, amount: float = 1.0) -> float:
        """Spend `amount` tokens: 0.0 when allowed, else the seconds until they are available (nothing spent)."""
        now = self.clock()
        with self._lock:
            tokens, last = self._buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            wait = 0.0
            if tokens >= amount:
                tokens -= amount
            else:
                wait = (amount - tokens) / self.rate
            self._buckets[key] = (tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        return wait


# Gradio's routes that start work: joining the queue, the queue-less route, the REST API and uploads.
# /component_server builds a session's state too (Gradio keys it by the body's session hash), so it is limited
# like a join: otherwise fresh hashes sent there would push others' sessions out of the store
LIMITED_SUFFIXES = ("/queue/join", "/run/predict", "/upload", "/component_server", "/component_server/")
LIMITED_PARTS = ("/call/",)
# Gradio's direct routes, /run/<api name> and /api/<api name>, run an event outside the queue (on a Space Gradio
# closes them; elsewhere it does not): closed here wherever the app runs. /run/predict (the page's queue-less
# events) stays, limited.
CLOSED_ROUTE = re.compile(r"/(run|api)/(?!predict/?$)[^/]+/?$")
# Routes nobody needs on a public page: Gradio's monitoring dashboard and its deep-link snapshots (a snapshot of
# anyone's page, for whoever knows their session hash, kept forever). The app's own links are ?state= and
# ?prototype=.
PRIVATE_ROUTE = re.compile(r"/(monitoring|deep_link)(/|$)")
MAX_BODY_BYTES = 2_000_000  # a join or predict body (uploads are not read here: Gradio's max_file_size bounds them)


class RequestLimiter:
    """ASGI middleware: per session, at most `burst` requests at once and `requests_per_s` sustained, at most
    `max_pending` events in the queue and `max_pending_model` of them model events; refused requests get HTTP 429
    with a message. `pending(session_hash, fn_index)` says what Gradio holds for a session (waiting or running):
    (all its events, those in the same concurrency group as fn_index, whether that group is the model's)."""

    def __init__(self, app, limits: Limits,
                 pending: Callable[[str, int | None], tuple[int, int, bool]] | None = None,
                 known_event: Callable[[int], bool] | None = None,
                 n_inputs: Callable[[int], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.limits = limits
        self.buckets = SessionBuckets(limits.requests_per_s, limits.burst)
        self.new_sessions = SessionBuckets(limits.new_sessions_per_minute / 60, limits.new_sessions_burst)
        # the latest 4 x max_sessions hashes seen, least recently heard from first, with when
        self.known_sessions: OrderedDict[str, float] = OrderedDict()
        self._known_lock = threading.Lock()
        self.clock = clock
        self.pending = pending or (lambda _session, _fn: (0, 0, False))
        self.known_event = known_event or (lambda _fn: True)
        self.n_inputs = n_inputs  # how many values a known event takes (a join sends one per input, states too)
        self.refused = 0  # how many requests were refused (for the log and the tests)

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "") if scope.get("type") == "http" else ""
        if PRIVATE_ROUTE.search(path):
            await _refuse(send, 404, "Not found.")
            return
        if scope.get("method") == "POST" and CLOSED_ROUTE.search(path):
            self.refused += 1
            await _refuse(send, 404, "This route is closed: call the app through its queue (gradio_client, or POST "
                                     "/gradio_api/call/<api name>).")
            return
        if scope.get("method") != "POST" or not (path.endswith(LIMITED_SUFFIXES)
                                                 or any(p in path for p in LIMITED_PARTS)):
            await self.app(scope, receive, send)
            return
        body, session, fn_index = b"", None, None
        if not path.endswith("/upload"):
            body = await _read_body(receive)
            if body is None:
                await _refuse(send, 413, "This request is too large.")
                return
            session, fn_index, n_values = _session_fn_and_values(body)
            if fn_index is not None and not self.known_event(fn_index):
                self.refused += 1
                await _refuse(send, 404, "No such event on this page: reload the page.")
                return
            if fn_index is not None and self.n_inputs is not None and path.endswith("/queue/join"):
                expected = self.n_inputs(fn_index)
                if n_values != expected:
                    self.refused += 1
                    sent = "no list of values" if n_values is None else f"{n_values} value(s)"
                    await _refuse(send, 422, f"This request sends {sent}; the event takes {expected}: reload "
                                             "the page.")
                    return
        address = _address(scope, self.limits.trusted_proxies)
        # /call/<api> without a session hash runs under a new one each time (Gradio takes the event's id): a new
        # session like a page's first request
        new = (session is None and any(p in path for p in LIMITED_PARTS)) or \
            (session is not None and not self._seen(session))
        if new:
            if self._all_active():
                # Gradio's store drops the least recently used session for a new one: here that would be a page
                # someone is using, so the newcomer waits instead
                self.refused += 1
                await _refuse(send, 503, "This app has as many pages open as it can hold: try again in a few "
                                         "minutes.")
                return
            wait = self.new_sessions.take(address)
            if wait > 0:
                self.refused += 1
                await _refuse(send, 429, f"Too many new pages from this address: wait {math.ceil(wait)} s and "
                                         "reload.")
                return
            if session is not None:
                self._remember(session)
        key = f"session:{session}" if session else address
        wait = self.buckets.take(key)
        if wait > 0:
            self.refused += 1
            await _refuse(send, 429, f"Too many requests from this page: wait {math.ceil(wait)} s and try again.")
            return
        if session is not None:
            total, same_group, model = self.pending(session, fn_index)
            if total >= self.limits.max_pending or (model and same_group >= self.limits.max_pending_model):
                self.refused += 1
                n = self.limits.max_pending_model if model and same_group >= self.limits.max_pending_model \
                    else self.limits.max_pending
                await _refuse(send, 429, f"This page already has {n} requests waiting"
                                         f"{' for the model' if n == self.limits.max_pending_model else ''}: wait "
                                         "for them to finish.")
                return
        if path.endswith("/upload"):
            await self.app(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)


    def _seen(self, session: str) -> bool:
        with self._known_lock:
            if session in self.known_sessions:
                self.known_sessions[session] = self.clock()
                self.known_sessions.move_to_end(session)
                return True
            return False

    def _all_active(self) -> bool:
        """Whether the max_sessions most recently heard-from sessions were all heard from within active_session_s:
        a new session would then push an active one out of Gradio's store."""
        cutoff = self.clock() - self.limits.active_session_s
        with self._known_lock:
            if len(self.known_sessions) < self.limits.max_sessions:
                return False
            recent = itertools.islice(reversed(self.known_sessions.values()), self.limits.max_sessions)
            return all(when >= cutoff for when in recent)

    def _remember(self, session: str) -> None:
        with self._known_lock:
            self.known_sessions[session] = self.clock()
            while len(self.known_sessions) > 4 * self.limits.max_sessions:
                self.known_sessions.popitem(last=False)


async def _read_body(receive) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    """The request's body again, then the connection's own messages (a disconnect when it comes)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _session_fn_and_values(body: bytes) -> tuple[str | None, int | None, int | None]:
    """The session hash, the event number and how many input values a join or predict body names (None where it
    names none, or its values are not a list)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None, None, None
    if not isinstance(data, dict):
        return None, None, None
    session, fn_index, values = data.get("session_hash"), data.get("fn_index"), data.get("data")
    return (session if isinstance(session, str) and session else None,
            fn_index if isinstance(fn_index, int) and not isinstance(fn_index, bool) else None,
            len(values) if isinstance(values, list) else None)


def _address(scope, trusted_proxies: int = 1) -> str:
    """The client's address: on a Space, the X-Forwarded-For entry its proxy appended (trusted_proxies from the
    right; what the client itself sent sits further left and is not believed), elsewhere the connection's peer."""
    if on_space():
        for name, value in scope.get("headers") or []:
            if name == b"x-forwarded-for":
                hops = [h.strip() for h in value.decode("latin-1").split(",") if h.strip()]
                if len(hops) >= trusted_proxies:
                    return "address:" + hops[-trusted_proxies]
    client = scope.get("client") or ("?", 0)
    return f"address:{client[0]}"


async def _refuse(send, status: int, message: str) -> None:
    body = json.dumps({"detail": message, "error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
