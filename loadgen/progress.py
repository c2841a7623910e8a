"""A progress bar on stderr while a bench runs: a redrawn line on a terminal, one line per step elsewhere."""

from __future__ import annotations

import sys
from typing import TextIO

from loadgen.runner import Progress


class ProgressLine:
    """Draws `step i/n load=L [#####-----] 7/15s issued 12 done 10 err 0`."""

    def __init__(self, num_steps: int, load_kind: str, stream: TextIO | None = None, width: int = 20) -> None:
        self.num_steps, self.load_kind, self.width = num_steps, load_kind, width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.step = 0
        self.load = 0.0
        self.duration_s: float | None = None
        self.num_requests: int | None = None

    def start_step(self, step: int, load: float, duration_s: float | None, num_requests: int | None) -> None:
        """A new step begins (announced on a line of its own when stderr is not a terminal)."""
        self.step, self.load, self.duration_s, self.num_requests = step, load, duration_s, num_requests
        if not self.tty:
            goal = f"{duration_s:g}s" if duration_s else f"{num_requests} req" if num_requests else "replay"
            head = f"step {step + 1}/{self.num_steps} {self.load_kind}={load:g}"
            self.stream.write(f"{head}: started ({goal})\n")
            self.stream.flush()

    def _line(self, p: Progress) -> str:
        if self.duration_s:
            frac, goal = min(p.elapsed_s / self.duration_s, 1.0), f"{p.elapsed_s:4.0f}/{self.duration_s:g}s"
        elif self.num_requests:
            frac, goal = min(p.done / self.num_requests, 1.0), f"{p.done}/{self.num_requests} req"
        else:
            frac, goal = 0.0, f"{p.elapsed_s:4.0f}s"
        bar = "#" * round(frac * self.width) + "-" * (self.width - round(frac * self.width))
        return (
            f"step {self.step + 1}/{self.num_steps} {self.load_kind}={self.load:g} [{bar}] {goal} "
            f"issued {p.issued} done {p.done} err {p.errors} in flight {p.in_flight}"
        )

    def __call__(self, p: Progress) -> None:
        """Redraw (terminal only; elsewhere the step summary line is enough)."""
        if self.tty:
            self.stream.write("\r\033[K" + self._line(p))
            self.stream.flush()

    def end_step(self, p: Progress) -> None:
        """Leave the step's final line in place."""
        self.stream.write(("\r\033[K" if self.tty else "") + self._line(p) + "\n")
        self.stream.flush()
