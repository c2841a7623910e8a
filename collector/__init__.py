"""stepscope collector: OTLP/HTTP receiver into ClickHouse."""
