"""One user's state: the interventions they switched on and their last generations. A plain value kept in
gr.State (one per browser tab or gradio_client session), never in a module global, so users never see each
other's interventions. Every change returns a new Session (dataclasses.replace), never mutates a shared one.

    s = Session().add(suppress_item(12, "year numbers"))
    s = s.add(scale_item(7, 2.0, "suffix -ing")).add(group_item("category", "numbers/time", [1, 3, 9]))
    s = s.add(inject_item(40, 3.0, "capital cities"))    # active at every token with activation 3, selected or not
    s.interventions()   # -> prism.Interventions(suppress={1, 3, 9, 12}, scale={7: 2.0}, inject={40: 3.0})
    s = s.remove(0)
    s = replace(s, controller=loaded, controller_on=True)   # a fitted controller too (app/controllers.py)
    s = s.with_suppress_mode("zero")   # suppressions remove the slices instead of re-routing (the app's default)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from prism import ActivationController, Interventions
from prism.model import SUPPRESS_MODES

if TYPE_CHECKING:
    from app.core import Generation

KINDS = ("suppress", "scale", "inject", "category", "search", "preset")
MAX_SCALE = 10.0
MAX_INJECT = 50.0  # an injected activation (the bank's own activations are a few units; larger breaks the text)
# How the app switches a prototype off (prism.Interventions.suppress_mode): re-routing keeps the text fluent where
# removing the slices leaves a hole (docs/RESULTS.md), so it is the app's default; the library's stays "zero".
DEFAULT_SUPPRESS_MODE = "reroute"
SUPPRESS_MODE_NAMES = {"reroute": "re-route to the nearest prototypes", "zero": "remove the slice"}


@dataclass(frozen=True)
class InterventionItem:
    """One row of the user's intervention list. factor 0 means suppress; for kind "inject" factor is the injected
    activation (> 0); a group (category or search result) is suppressed as a whole; ids are fixed when the item is
    added."""

    kind: str  # one of KINDS
    target: str  # what the user picked: "#12 year numbers", a category, a search query
    prototype_ids: tuple[int, ...]
    factor: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "inject":
            if not 0.0 < self.factor <= MAX_INJECT or len(self.prototype_ids) != 1:
                raise ValueError(f"an injected activation must be above 0 and at most {MAX_INJECT:g}, got "
                                 f"{self.factor}")
        elif not 0.0 <= self.factor <= MAX_SCALE:
            raise ValueError(f"scale factor must be between 0 and {MAX_SCALE:g}, got {self.factor}")

    def describe(self) -> str:
        if self.kind == "inject":
            return f"inject prototype {self.target} at activation {self.factor:g} (1 prototype(s))"
        action = "suppress" if self.factor == 0 else f"scale x{self.factor:g}"
        what = {"suppress": "prototype", "scale": "prototype", "category": "category", "search": "search",
                "preset": "preset"}[self.kind]
        return f"{action} {what} {self.target} ({len(self.prototype_ids)} prototype(s))"


def suppress_item(prototype_id: int, label: str = "") -> InterventionItem:
    return InterventionItem("suppress", f"#{int(prototype_id)} {label}".strip(), (int(prototype_id),))


def scale_item(prototype_id: int, factor: float, label: str = "") -> InterventionItem:
    kind = "suppress" if float(factor) == 0 else "scale"
    return InterventionItem(kind, f"#{int(prototype_id)} {label}".strip(), (int(prototype_id),), float(factor))


def inject_item(prototype_id: int, activation: float, label: str = "") -> InterventionItem:
    """Prototype `prototype_id` active at every token with `activation`, whether the model selects it or not."""
    return InterventionItem("inject", f"#{int(prototype_id)} {label}".strip(), (int(prototype_id),), float(activation))


def group_item(kind: str, target: str, prototype_ids: list[int]) -> InterventionItem:
    if not prototype_ids:
        raise ValueError(f"{kind} {target!r} matches no prototype: nothing to suppress")
    return InterventionItem(kind, target, tuple(sorted({int(i) for i in prototype_ids})))


@dataclass(frozen=True)
class Session:
    items: tuple[InterventionItem, ...] = ()
    original: Generation | None = None  # the last generation without interventions
    intervened: Generation | None = None  # the same settings with this session's interventions
    selected: tuple[str, int] | None = None  # ("original" | "intervened" | "prompt", token index)
    controller: ActivationController | None = None  # a loaded prototype controller (app/controllers.py)
    controller_on: bool = False  # whether the intervened text uses it
    controller_name: str | None = None  # its shipped name (app/controllers.py SHIPPED), None for other files
    suppress_mode: str = DEFAULT_SUPPRESS_MODE  # how every suppression of this session acts (SUPPRESS_MODE_NAMES)

    def add(self, item: InterventionItem) -> Session:
        return replace(self, items=(*self.items, item))

    @property
    def n_rows(self) -> int:
        """Rows of the intervention list: the items, then the loaded controller (on or off) as the last row."""
        return len(self.items) + (self.controller is not None)

    def remove(self, index: int) -> Session:
        """Without row `index`: an item, or the controller when it is the controller's row."""
        index = int(index)
        if not 0 <= index < self.n_rows:
            raise ValueError(f"there is no intervention #{index}: the list has {self.n_rows}")
        if index == len(self.items):
            return replace(self, controller=None, controller_on=False, controller_name=None)
        return replace(self, items=self.items[:index] + self.items[index + 1:])

    def clear(self) -> Session:
        """No interventions: no items and no controller (how suppressions act is a setting and stays)."""
        return replace(self, items=(), controller=None, controller_on=False, controller_name=None)

    def with_suppress_mode(self, mode: str) -> Session:
        """The same session with its suppressions re-routed ("reroute") or removed ("zero"); a mode's display
        name is accepted too."""
        names = {v: k for k, v in SUPPRESS_MODE_NAMES.items()}
        mode = names.get(str(mode), str(mode))
        if mode not in SUPPRESS_MODES:
            raise ValueError(f"suppress mode must be one of {', '.join(SUPPRESS_MODES)} "
                             f"({'; '.join(f'{k}: {v}' for k, v in SUPPRESS_MODE_NAMES.items())}), got "
                             f"{mode[:30]!r}")
        return replace(self, suppress_mode=mode)

    def interventions(self) -> Interventions:
        """The items as one prism.Interventions: a suppression wins over any scaling or injection of the same
        prototype; of two scalings or injections of one prototype the later one counts; factor 1 is no change."""
        suppress: set[int] = set()
        scale: dict[int, float] = {}
        inject: dict[int, float] = {}
        for item in self.items:
            for pid in item.prototype_ids:
                if item.kind == "inject":
                    inject[pid] = item.factor
                    scale.pop(pid, None)
                elif item.factor == 0:
                    suppress.add(pid)
                else:
                    scale[pid] = item.factor
                    inject.pop(pid, None)
        scale = {p: f for p, f in scale.items() if p not in suppress and f != 1.0}
        inject = {p: a for p, a in inject.items() if p not in suppress}
        controller = self.controller if self.controller_on else None
        return Interventions(suppress=frozenset(suppress), scale=scale, inject=inject, controller=controller,
                             suppress_mode=self.suppress_mode)

    def rows(self) -> list[list]:
        """The intervention list as table rows: index, what, prototype ids; a loaded controller is the last row."""
        rows = [[n, item.describe(), _ids(item.prototype_ids)] for n, item in enumerate(self.items)]
        if self.controller is not None:
            moved = self.controller.moved()
            rows.append([len(self.items), f"controller {self.controller_title()} "
                         f"({'on' if self.controller_on else 'loaded, off'}; reweights {len(moved)} prototype(s))",
                         _ids(moved)])
        return rows

    def controller_title(self) -> str:
        if self.controller is None:
            return ""
        return self.controller_name or str(self.controller.meta.get("task") or "from a file")

    def applied(self) -> str:
        """What the intervened text applies, in a few words (the column title): '' when nothing."""
        iv = self.interventions()
        parts = []
        if iv.suppress:
            how = "re-routed" if self.suppress_mode == "reroute" else "slices removed"
            parts.append(f"{len(iv.suppress)} suppressed ({how})")
        if iv.scale:
            parts.append(f"{len(iv.scale)} scaled")
        if iv.inject:
            parts.append(f"{len(iv.inject)} injected")
        if iv.controller is not None:
            parts.append(f"controller {self.controller_title()}")
        return ", ".join(parts)


def _ids(ids) -> str:
    ids = [int(i) for i in ids]
    return ", ".join(str(i) for i in ids[:20]) + (" ..." if len(ids) > 20 else "")
