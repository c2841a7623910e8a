"""stepscope instrumentation: engine events -> OpenTelemetry spans and metrics (docs/spans.md)."""
