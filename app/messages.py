"""How a handler talks to the user: a status line (ok, or a problem with a warning sign) and the guard every
handler wears, so that nothing raw (a traceback, an object address) ever reaches the page or the API.

    @guarded
    def suppress(studio, prototype_id, session): ...        # an AppError or a crash becomes one short line
    return session, rows, problem(err)                       # "⚠️ no prototype 9999: ..."
"""

from __future__ import annotations

import functools
import inspect
import logging

import gradio as gr

from app.errors import AppError

logger = logging.getLogger(__name__)


def guarded(fn):
    """A handler that never shows a raw exception: an AppError that escapes becomes its message, anything else is
    logged with its traceback and the user reads one line (Gradio shows a gr.Error's message, nothing else, since
    the app launches with show_error=False). Generators stay generators, and the signature (gr.Request,
    gr.SelectData) is the handler's own, so Gradio fills in what it asks for."""

    def fail(err: Exception) -> gr.Error:
        # print_exception=False: Gradio would print a traceback for every gr.Error. An expected refusal is one
        # log line; an unexpected error is logged once, with its traceback, here.
        if isinstance(err, AppError):
            logger.info("%s refused: %s", fn.__name__, short(err))
            return gr.Error(short(err), print_exception=False)
        logger.exception("%s failed", fn.__name__)
        return gr.Error(f"Something went wrong on the server in {fn.__name__} (it is logged); nothing was changed. "
                        "Try other input or reload the page.", print_exception=False)

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def wrapped_generator(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except gr.Error:
                raise
            except Exception as err:  # noqa: BLE001 - the point: nothing raw reaches the user
                raise fail(err) from None
        return wrapped_generator

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except gr.Error:
            raise
        except Exception as err:  # noqa: BLE001
            raise fail(err) from None
    return wrapped


def checked_inputs(demo: gr.Blocks) -> None:
    """Every input component of `demo` answers a value the page never sends (a hand-made API call: a table that
    is not one, a number past a slider's end) with a short gr.Error and one log line. Left alone, Gradio prints a
    traceback for each, and with show_error=False the caller reads an error without a message."""
    seen: set[int] = set()
    for fn in demo.fns.values():
        for block in fn.inputs:
            if block._id not in seen and callable(getattr(block, "preprocess", None)):
                seen.add(block._id)
                block.preprocess = _checked(block)


def _checked(block):
    preprocess = block.preprocess
    name = str(getattr(block, "label", None) or getattr(block, "elem_id", None) or type(block).__name__.lower())

    @functools.wraps(preprocess)
    def checked(payload):
        try:
            return preprocess(payload)
        except gr.Error as err:  # Gradio's own check (a slider's range): its message is fine, its traceback not
            logger.info("input %r refused: %s", name, short(err.message))
            err.print_exception = False
            raise
        except Exception as err:  # noqa: BLE001 - a malformed value: say which input, never the raw exception
            logger.info("input %r refused: %s: %s", name, type(err).__name__, short(err))
            raise gr.Error(f"'{_cut(name)}' got a value this page never sends: reload the page.",
                           print_exception=False) from None

    return checked


def _cut(name: str, max_chars: int = 40) -> str:
    return name if len(name) <= max_chars else name[:max_chars - 1] + "…"


MAX_MESSAGE_CHARS = 200  # a status line; an input quoted in a message is cut far shorter (limits.shown)


def ok(message: str) -> str:
    return message


def short(message: object) -> str:
    """A message cut to MAX_MESSAGE_CHARS (a refusal never echoes a long input back whole)."""
    text = str(message)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


def problem(err: Exception | str) -> str:
    return "⚠️ " + short(err)
