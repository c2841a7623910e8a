"""stepscope diagnosis: why did TTFT/TPOT regress? The public API, in one place.

    from diagnosis import open_reader, diagnose, TimeRange, DiagnosisConfig
    source = open_reader(store="chdb:///path/to/data")           # or open_reader(url="http://127.0.0.1:4318")
    result = diagnose(source, window=TimeRange(t0, t1))          # baseline: a change point inside the window
    result = diagnose(source, window=TimeRange(t1, t2), baseline=TimeRange(t0, t1))
    result.to_json()["findings"][0]["cause"]                     # e.g. "prefix_cache_miss"
    source.close()

- `open_reader(store=, url=, token=) -> Reader` (`collector.client`, the one read path): read-only SQL
  through `collector.store.Store` (a DSN) or a running collector's `POST /api/sql` (chDB allows one
  process per data directory); failures are `ReadError`.
- `diagnose(source, window=None, baseline=None, config=None) -> Diagnosis`: `window` None means everything
  stored; `baseline` None means the change point inside the window splits it into before and after.
- `Diagnosis.to_json()`: `{"window", "baseline", "regressions", "findings", "not_enough_data",
  "decomposition", "data", "notes"}` (docs/diagnosis.md). `render(diagnosis, "text" | "md" | "json")`.
- `CAUSES`: the cause names a finding can carry. Thresholds: `DiagnosisConfig` (each with its reason).
"""

from collector.client import Reader, ReadError, open_reader
from collector.timerange import TimeRange, parse_time
from diagnosis.config import DiagnosisConfig
from diagnosis.pipeline import diagnose
from diagnosis.records import Diagnosis, Evidence, Finding, NotEnoughData, Regression
from diagnosis.render import render
from diagnosis.rules import CAUSES

__all__ = [
    "CAUSES",
    "Diagnosis",
    "DiagnosisConfig",
    "Evidence",
    "Finding",
    "NotEnoughData",
    "ReadError",
    "Reader",
    "Regression",
    "TimeRange",
    "diagnose",
    "open_reader",
    "parse_time",
    "render",
]
