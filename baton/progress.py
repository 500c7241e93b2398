"""Progress of long work (weights loading, graph capture, warm-up, model conversion) on stderr,
one way for every layer: on a terminal, a line redrawn in place; anywhere else (a file, a pipe,
a log collector) a plain line at the start, at each quarter and at the end, never a '\\r'.
Torch-free and import-free, so the models and the engine can use it as well as the services.
"""
from __future__ import annotations

import math
import re
import sys

TAG = "[baton] "
QUARTER = 0.25
_PERCENT = re.compile(r"(\d{1,3}(?:\.\d+)?)%")
_COUNT = re.compile(r"(\d+)/(\d+)")


def redraws(out) -> bool:
    """Does `out` show a line redrawn in place (a terminal)?"""
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError, OSError):      # no isatty, or closed
        return False


def fraction_of(text: str) -> float | None:
    """How far a progress line says it is: its first `i/n` (exact), else its percentage (tqdm
    shows 271/272 as 100%)."""
    if (hit := _COUNT.search(text)) and int(hit[2]):
        return int(hit[1]) / int(hit[2])
    if hit := _PERCENT.search(text):
        return float(hit[1]) / 100
    return None


class Milestones:
    """Which states of one task earn a line of their own where nothing redraws: the first one
    seen, then the first past each quarter."""

    def __init__(self):
        self.next = 0.0

    def due(self, fraction: float) -> bool:
        if fraction < self.next:
            return False
        self.next = (math.floor(fraction / QUARTER + 1e-9) + 1) * QUARTER
        return True


class Progress:
    """`[baton] {what}: i/n {unit}` as `update(i)` is called; `done(text)` leaves its last line.
    `out`: None writes to sys.stderr as it is then (setup_logging may wrap it after this is made)."""

    def __init__(self, what: str, total: int, unit: str = "", out=None):
        self.what, self.total, self.unit, self.out = what, total, unit, out
        self.marks = Milestones()
        self.drawn = 0               # the width drawn in place: a shorter line pads over it

    def update(self, done: int) -> None:
        out = self.out or sys.stderr
        text = f"{TAG}{self.what}: {done}/{self.total}{' ' + self.unit if self.unit else ''}"
        if redraws(out):
            self._draw(out, text)
        elif done < self.total and self.marks.due(done / self.total):     # (the end: done() says it)
            print(text, file=out, flush=True)

    def done(self, text: str) -> None:
        out = self.out or sys.stderr
        if redraws(out):
            self._draw(out, f"{TAG}{text}")
            print(file=out, flush=True)
        else:
            print(f"{TAG}{text}", file=out, flush=True)

    def _draw(self, out, text: str) -> None:
        out.write(f"\r{text.ljust(self.drawn)}")
        out.flush()
        self.drawn = len(text)


class Flattened:
    """Text written for a terminal, made plain for where nothing redraws: a line redrawn in
    place (states apart by '\\r': tqdm's bars, anything a library prints) becomes its milestones
    (Milestones, told by the percentage or `i/n` it shows) and its last state; other lines pass."""

    def __init__(self):
        self.pending = ""
        self._new_line()

    def feed(self, text: str) -> list[str]:
        """The whole plain lines `text` completes (without their newline)."""
        self.pending += text
        *ended, self.pending = self.pending.split("\n")
        lines = [plain for line in ended for plain in self._ended(line)]
        if "\r" in self.pending:               # states drawn over so far; the last may still grow
            *states, self.pending = self.pending.split("\r")
            lines += self._redrawn(states)
        return lines

    def _new_line(self) -> None:
        self.marks, self.shown_at, self.latest, self.redrawing = Milestones(), None, "", False

    def _redrawn(self, states: list[str]) -> list[str]:
        self.redrawing = True
        shown = []
        for state in (s.rstrip() for s in states if s.strip()):
            self.latest = state
            fraction = fraction_of(state)
            if fraction is not None and self.marks.due(fraction):
                self.shown_at = fraction
                shown.append(state)
        return shown

    def _ended(self, line: str) -> list[str]:
        if not self.redrawing and "\r" not in line:
            return [line]
        *states, last = line.split("\r")
        shown = self._redrawn(states)
        last = last.rstrip() or self.latest
        if last.strip() and (fraction_of(last) is None or fraction_of(last) != self.shown_at):
            shown.append(last)               # where it ended, unless that milestone was just shown
        self._new_line()
        return shown
