"""The fleet filter every page shares: the services and instances chosen in the sidebar (none chosen: all),
as the parameters of `queries.SCOPE` and as the line that tells the page what it is showing.

Pure: the sidebar (dashboard/ui.py) reads the widgets; tests build a `Scope` directly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Scope:
    """The services and instances whose `requests` and `steps` rows the pages read (empty: all of them)."""

    services: tuple[str, ...] = ()
    instances: tuple[str, ...] = ()

    @property
    def everything(self) -> bool:
        return not self.services and not self.instances

    def params(self) -> dict[str, list[str]]:
        """The `Array(String)` parameters of `queries.SCOPE`."""
        return {"services": list(self.services), "instances": list(self.instances)}

    def note(self) -> str | None:
        """What the filter keeps, for the page (None when it keeps everything)."""
        if self.everything:
            return None
        parts = [_named("service", self.services), _named("instance", self.instances)]
        return "Filtered to " + " and ".join(p for p in parts if p) + " (sidebar)."


def _named(kind: str, names: tuple[str, ...]) -> str:
    if not names:
        return ""
    return f"{kind}s {', '.join(label(n) for n in names)}" if len(names) > 1 else f"{kind} {label(names[0])}"


def label(name: str) -> str:
    """An option as the sidebar shows it (rows written without the resource attribute hold '')."""
    return name or "(unset)"


def instances_of(pairs: Iterable[tuple[str, str]], services: Iterable[str]) -> list[str]:
    """The instances that served any of `services` (all instances when none is chosen), sorted."""
    chosen = set(services)
    return sorted({instance for service, instance in pairs if not chosen or service in chosen})
