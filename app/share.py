"""Shareable state: a link that restores a prompt, its settings and seed, the interventions and the explained token,
and the interventions as a JSON file that can be imported back. Both are plain data checked field by field, so
what a link or a file can do is exactly what a user can click; nothing in them is a path, code or SQL.

    token = encode_link(studio, settings, session, selected=("intervened", 3))   # -> "eJy...-Q.3f2a9c0d1b2e"
    url = f"{base}/?state={token}"
    link = decode_link(studio, token)            # LinkError with the reason, or Link(settings, session, selected)
    data = interventions_json(studio, session)   # {"format": "prism-interventions/1", ...}
    session = import_interventions(studio, data, session)

A link is base64url(zlib(JSON)) + "." + the first 16 hex digits of the JSON's sha256. The checksum catches a link
cut short or edited by hand ("this link was changed or cut off"); it is not a signature: anyone can make a valid
link, which is fine because a valid link can only set what the page's own controls set. A link made on another
model (another prototype bank) is refused, since its prototype ids would name other prototypes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import zlib
from dataclasses import dataclass, replace

from app import controllers as app_controllers
from app.core import MAX_SEED, MAX_TEMPERATURE, AppError, GenerationSettings, Studio
from app.session import KINDS, MAX_INJECT, MAX_SCALE, InterventionItem, Session
from prism.controllers import bank_fingerprint
from prism.model import SUPPRESS_MODES

LINK_VERSION = 1
INTERVENTIONS_FORMAT = "prism-interventions/1"
PARAM = "state"  # the query parameter: /?state=TOKEN
MAX_TOKEN_CHARS = 64_000
MAX_JSON_BYTES = 1_000_000
MAX_TARGET_CHARS = 200


class LinkError(AppError):
    """A link or an interventions file that cannot be used; the message says why, and nothing was applied."""


@dataclass(frozen=True)
class Link:
    settings: GenerationSettings
    session: Session  # the interventions only (no texts yet)
    selected: tuple[str, int] | None


def fingerprint(studio: Studio) -> str:
    """Which model a link or file was made on: the start of its prototype bank's sha256 (cached on the studio)."""
    if getattr(studio, "_share_fingerprint", None) is None:
        studio._share_fingerprint = bank_fingerprint(studio.model)[:16]
    return studio._share_fingerprint


# ----------------------------------------------------------------------------------------------------------------
# Interventions as data (shared by links and the JSON file).


def interventions_data(session: Session) -> dict:
    """The session's interventions as plain data (no texts, no model)."""
    return {"suppress_mode": session.suppress_mode,
            "items": [{"kind": i.kind, "target": i.target, "prototype_ids": list(i.prototype_ids),
                       "factor": i.factor} for i in session.items],
            "controller": session.controller_name if session.controller is not None else None,
            "controller_on": bool(session.controller_on) if session.controller is not None else False}


def interventions_json(studio: Studio, session: Session) -> dict:
    """The interventions file: what `import_interventions` reads back. A controller loaded from a file that is not
    shipped cannot be named in it; `notes` says so."""
    data = {"format": INTERVENTIONS_FORMAT, "model": fingerprint(studio), **interventions_data(session)}
    if session.controller is not None and session.controller_name is None:
        data["notes"] = ["the loaded controller is not a shipped one, so it is not in this file: load it again "
                         "from its file"]
    return data


def parse_interventions(studio: Studio, data, base: Session, source: str = "link") -> Session:
    """`base` with the interventions that `data` describes (replacing base's); LinkError when any field is wrong."""
    if not isinstance(data, dict):
        raise LinkError(f"the {source}'s interventions are not an object")
    unknown = set(data) - {"format", "model", "suppress_mode", "items", "controller", "controller_on", "notes"}
    if unknown:
        raise LinkError(f"the {source} has unknown fields: {', '.join(sorted(map(str, unknown)))[:200]}")
    mode = data.get("suppress_mode", "reroute")
    if mode not in SUPPRESS_MODES:
        raise LinkError(f"the {source}'s suppress_mode must be one of {', '.join(SUPPRESS_MODES)}")
    raw_items = data.get("items", [])
    if not isinstance(raw_items, list) or len(raw_items) > studio.limits.max_interventions:
        raise LinkError(f"the {source}'s items must be a list of at most {studio.limits.max_interventions} (this "
                        "app's limit on interventions)")
    n = studio.n_prototypes
    items = []
    for k, raw in enumerate(raw_items):
        if not isinstance(raw, dict) or set(raw) - {"kind", "target", "prototype_ids", "factor"}:
            raise LinkError(f"item {k} of the {source} is not {{kind, target, prototype_ids, factor}}")
        kind, target, ids, factor = (raw.get("kind"), raw.get("target", ""), raw.get("prototype_ids"),
                                     raw.get("factor", 0.0))
        if kind not in KINDS:
            raise LinkError(f"item {k}: kind must be one of {', '.join(KINDS)}")
        if not isinstance(target, str) or len(target) > MAX_TARGET_CHARS:
            raise LinkError(f"item {k}: target must be text of at most {MAX_TARGET_CHARS} characters")
        if not isinstance(ids, list) or not ids or len(ids) > n or \
                not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in ids):
            raise LinkError(f"item {k}: prototype_ids must be a non-empty list of ids 0..{n - 1} of this model")
        if len(set(ids)) != len(ids) or (kind in ("suppress", "scale", "inject") and len(ids) != 1):
            raise LinkError(f"item {k}: prototype_ids repeat, or a single-prototype item names several")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
            raise LinkError(f"item {k}: factor must be a number")
        if kind == "inject" and not 0.0 < factor <= MAX_INJECT:
            raise LinkError(f"item {k}: an injected activation must be in (0, {MAX_INJECT:g}]")
        if kind != "inject" and (not 0.0 <= factor <= MAX_SCALE or (kind != "scale" and factor != 0)):
            raise LinkError(f"item {k}: factor must be a number in [0, {MAX_SCALE:g}] (0 unless the kind is scale)")
        items.append(InterventionItem(kind, target, tuple(ids), float(factor)))
    session = replace(base, items=tuple(items), suppress_mode=mode, controller=None, controller_on=False,
                      controller_name=None)
    name, on = data.get("controller"), data.get("controller_on", False)
    if not isinstance(on, bool):
        raise LinkError(f"the {source}'s controller_on must be true or false")
    if name is not None:
        if not isinstance(name, str):
            raise LinkError(f"the {source}'s controller must be the name of a shipped controller")
        try:
            loaded = app_controllers.load_shipped(studio, name)
        except AppError as err:
            raise LinkError(f"the {source} names a controller this app cannot load: {err}") from None
        session = replace(session, controller=loaded, controller_on=on, controller_name=name)
    return session


def import_interventions(studio: Studio, data, base: Session) -> Session:
    """`base` with the interventions of an interventions file (parsed JSON), replacing its own."""
    if not isinstance(data, dict) or data.get("format") != INTERVENTIONS_FORMAT:
        raise LinkError(f"this is not an interventions file (its \"format\" must be {INTERVENTIONS_FORMAT!r})")
    if data.get("model") != fingerprint(studio):
        raise LinkError("this interventions file was made on another model (another prototype bank): its prototype ids "
                    "would name other prototypes here")
    return parse_interventions(studio, data, base, source="file")


# ----------------------------------------------------------------------------------------------------------------
# Links.


def link_data(studio: Studio, settings: GenerationSettings, session: Session,
              selected: tuple[str, int] | None = None) -> dict:
    return {"v": LINK_VERSION, "model": fingerprint(studio), "prompt": settings.prompt,
            "max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature, "top_p": settings.top_p,
            "seed": settings.seed, "interventions": interventions_data(session),
            "selected": None if selected is None else {"run": selected[0], "index": int(selected[1])}}


def encode_link(studio: Studio, settings: GenerationSettings, session: Session,
                selected: tuple[str, int] | None = None) -> str:
    """The state as a URL-safe token (the value of ?state=)."""
    raw = json.dumps(link_data(studio, settings, session, selected), separators=(",", ":"), sort_keys=True).encode()
    body = base64.urlsafe_b64encode(zlib.compress(raw, 9)).decode().rstrip("=")
    return f"{body}.{hashlib.sha256(raw).hexdigest()[:16]}"


def decode_link(studio: Studio, token: str) -> Link:
    """The state a token describes; LinkError (and nothing applied) when it is damaged, edited or made elsewhere."""
    damaged = "this link was changed or cut off (its checksum does not match): ask for it again"
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS or token.count(".") != 1:
        raise LinkError(damaged)
    body, check = token.split(".")
    try:
        packed = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        unpacker = zlib.decompressobj()
        raw = unpacker.decompress(packed, MAX_JSON_BYTES)
        if unpacker.unconsumed_tail:
            raise LinkError("this link holds too much data")
    except (binascii.Error, ValueError, zlib.error):
        raise LinkError(damaged) from None
    if hashlib.sha256(raw).hexdigest()[:16] != check:
        raise LinkError(damaged)
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise LinkError(damaged) from None
    if not isinstance(data, dict) or data.get("v") != LINK_VERSION:
        raise LinkError(f"this link was made by another version of the app (it is not version {LINK_VERSION})")
    if set(data) != {"v", "model", "prompt", "max_new_tokens", "temperature", "top_p", "seed", "interventions",
                     "selected"}:
        raise LinkError("this link's fields are not the ones the app writes")
    if data["model"] != fingerprint(studio):
        raise LinkError("this link was made on another model (another prototype bank): its prototype ids would name "
                    "other prototypes here")
    prompt, max_new, temperature, top_p, seed = (data[k] for k in ("prompt", "max_new_tokens", "temperature",
                                                                   "top_p", "seed"))
    limits = studio.limits
    if not isinstance(prompt, str) or not prompt.strip() or len(prompt) > limits.max_prompt_chars:
        raise LinkError(f"the link's prompt must be text of 1 to {limits.max_prompt_chars} characters")
    if not _int(max_new) or not 1 <= max_new <= limits.max_new_tokens:
        raise LinkError(f"the link's max_new_tokens must be a whole number in 1..{limits.max_new_tokens}")
    if not _number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise LinkError(f"the link's temperature must be in [0, {MAX_TEMPERATURE:g}]")
    if not _number(top_p) or not 0 < top_p <= 1:
        raise LinkError("the link's top_p must be in (0, 1]")
    if not _int(seed) or not 0 <= seed <= MAX_SEED:
        raise LinkError(f"the link's seed must be a whole number in 0..{MAX_SEED}")
    session = parse_interventions(studio, data["interventions"], Session())
    settings = GenerationSettings(prompt=prompt, max_new_tokens=max_new, temperature=float(temperature),
                                  top_p=float(top_p), seed=seed)
    try:  # the rules Generate and Copy link apply (text that is not valid UTF-8, a prompt of too many tokens, ...)
        prompt_ids, _, _ = studio.encode_prompt(studio.check_settings(settings))
    except AppError as err:
        raise LinkError(f"the link's settings cannot be used: {err}") from None
    return Link(settings=settings, session=session, selected=_selected(data["selected"], max_new, len(prompt_ids)))


def _selected(selected, max_new: int, n_prompt: int) -> tuple[str, int] | None:
    """The link's explained token as (run, index), checked: a generated token 0..max_new-1 of either text, or a
    prompt token 1..n_prompt-1 (the first has nothing before it to explain it)."""
    if selected is None:
        return None
    ok = isinstance(selected, dict) and set(selected) == {"run", "index"} and _int(selected["index"]) and (
        (selected["run"] in ("original", "intervened") and 0 <= selected["index"] < max_new)
        or (selected["run"] == "prompt" and 1 <= selected["index"] < n_prompt))
    if not ok:
        raise LinkError("the link's selected token must be {run: original|intervened, index: 0..max_new_tokens-1} "
                        "or {run: prompt, index: 1..prompt tokens-1}")
    return selected["run"], selected["index"]


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
