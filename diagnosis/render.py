"""The findings JSON rendered for people: plain text for a terminal, Markdown for an incident doc. Both
render `Diagnosis.to_json()`, so they say exactly what the JSON says."""

from __future__ import annotations

import json
from typing import Any

from collector.timerange import iso
from diagnosis.records import Diagnosis

FORMATS = ("text", "json", "md")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.3g}"
        return f"{v:.4g}"
    return str(v)


def _window(w: dict[str, Any] | None) -> str:
    return "-" if not w else f"{w['from_iso']} .. {w['to_iso']} ({w['seconds']:.0f} s)"


def _lines(d: dict[str, Any], md: bool) -> list[str]:
    h1, h2, bullet = ("# ", "## ", "- ") if md else ("", "", "  ")
    code = "`" if md else ""
    out = [f"{h1}stepscope diagnosis"]
    out.append(f"{bullet}window:   {_window(d['window'])}")
    source = f" [{d['baseline']['source']}]" if d["baseline"] else ""
    out.append(f"{bullet}baseline: {_window(d['baseline'])}{source}")
    out += [f"{bullet}note: {n}" for n in d["notes"]]
    out.append("")
    out.append(f"{h2}Regressions" + ("" if d["regressions"] else ": none"))
    if d["regressions"] and md:
        out += ["| metric | baseline | current | ratio | p |", "|---|---|---|---|---|"]
    for r in d["regressions"]:
        cells = [
            r["metric"],
            _fmt(r["baseline"]),
            _fmt(r["current"]),
            f"x{_fmt(r['ratio'])}",
            _fmt(r["p_value"]),
        ]
        out.append(
            "| " + " | ".join(cells) + " |"
            if md
            else f"  {cells[0]:<12} {cells[1]:>10} -> {cells[2]:<10} {cells[3]:<8} p={cells[4]}"
        )
    out.append("")
    out.append(f"{h2}Findings" + ("" if d["findings"] else ": none"))
    for i, f in enumerate(d["findings"], 1):
        onset = iso(f["onset"]) if f["onset"] is not None else "-"
        out.append("")
        title = f"{i}. {code}{f['cause']}{code}  confidence {f['confidence']:.2f}, onset {onset}"
        out.append(("### " if md else "") + title)
        if f.get("summary"):
            out.append(f"{bullet}{f['summary']}")
        out.append(f"{bullet}symptoms: {', '.join(f['symptoms'])}")
        for e in f["evidence"]:
            indent = bullet if md else bullet + "  "
            out.append(f"{indent}{e['metric']}: {_fmt(e['baseline'])} -> {_fmt(e['current'])}")
        out.append(f"{bullet}lever: {f['lever']}")
        out += ["", "```sql", f["sql"], "```"] if md else [f"{bullet}sql: {f['sql']}"]
    if d["not_enough_data"]:
        out.append("")
        out.append(f"{h2}Not enough data")
        out += [f"{bullet}{n['cause']}: needs {n['missing']}" for n in d["not_enough_data"]]
    return out


def render(diagnosis: Diagnosis, fmt: str = "text") -> str:
    """The diagnosis as `text`, `md` (Markdown) or `json` (indented)."""
    d = diagnosis.to_json()
    if fmt == "json":
        return json.dumps(d, indent=2)
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}")
    return "\n".join(_lines(d, fmt == "md")) + "\n"
