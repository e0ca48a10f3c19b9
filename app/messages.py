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


MAX_MESSAGE_CHARS = 200  # a status line; an input quoted in a message is cut far shorter (limits.shown)


def ok(message: str) -> str:
    return message


def short(message: object) -> str:
    """A message cut to MAX_MESSAGE_CHARS (a refusal never echoes a long input back whole)."""
    text = str(message)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


def problem(err: Exception | str) -> str:
    return "⚠️ " + short(err)
