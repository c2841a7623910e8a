"""Helpers the tests share: a free port and waiting (`net`), an OTLP/HTTP receiver (`otlp`), a running
`stepscope collector` (`collector`). Import them as `tests.support.<module>`."""
