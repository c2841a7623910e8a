"""Every dashboard default, in one dataclass. The CLI is built from it and hands it to the Streamlit
process through the environment (`to_env`/`from_env`), so the token never shows in a process list."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

ENV_PREFIX = "STEPSCOPE_DASHBOARD_"


@dataclass(slots=True)
class DashboardConfig:
    """What the dashboard reads and how it judges it."""

    api: str = "http://127.0.0.1:4318"  # the collector's query API: the only data source
    token: str | None = None  # for a collector started with --token
    host: str = "127.0.0.1"  # where the dashboard listens (0.0.0.0 to reach it from elsewhere)
    port: int = 8501
    bench_dir: str | None = None  # where `stepscope bench` results.json files are looked for
    slo_ttft_s: float = 2.0  # the SLO lines and tiles (the bench check's defaults)
    slo_tpot_s: float = 0.2
    refresh_s: int = 30  # auto-refresh period when switched on
    http_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.api.startswith(("http://", "https://")):
            raise ValueError(f"--api must be an http(s) URL, got {self.api!r}")
        self.api = self.api.rstrip("/")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be 1-65535, got {self.port}")
        for name in ("slo_ttft_s", "slo_tpot_s", "http_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.refresh_s < 1:
            raise ValueError("refresh_s must be at least 1 second")

    def to_env(self) -> dict[str, str]:
        """The config as environment variables (None fields left out)."""
        return {
            ENV_PREFIX + f.name.upper(): str(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> DashboardConfig:
        """The config the CLI put in the environment; defaults for what it left out."""
        environ = dict(os.environ) if environ is None else environ
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            kind = type(f.default) if f.default is not None else str
            values[f.name] = kind(raw) if kind in (int, float) else raw
        return cls(**values)  # type: ignore[arg-type]
