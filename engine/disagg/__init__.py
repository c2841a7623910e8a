"""Prefill/decode disaggregation (docs/disagg.md): a router (the OpenAI front end with a different engine
client), prefill and decode workers (core processes with a role), KV streamed between them over TCP.

| module | concept |
|---|---|
| `handoff.py` | the engine-core API: prefill-only requests, reserved remote KV, commit |
| `kv_wire.py` | KV blocks out of / into a paged cache (plain or int8), and the KV frames |
| `kv_link.py` | the sender thread (token-bucket paced) and the decode worker's listener |
| `worker.py` | the worker process: the step loop of a prefill or decode worker |
| `router.py` | `DisaggClient`: registration, picking by load, retries, health |
| `launch.py` | `stepscope serve --disagg` / `--role`: starting the processes |
"""
