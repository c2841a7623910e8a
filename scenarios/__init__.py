"""stepscope scenarios: real faults switched on mid-run, and the eval that scores the diagnosis on them.

- `faults`: the fault table (names, defaults, eval ranges, the knobs each turns); imports nothing else.
- `config`: `ScenarioConfig` and the steady two-stream workload.
- `procs`: the collector and engine subprocesses of a run.
- `calibrate`: the engine's capacity on this machine, which sizes the load.
- `runner`: one run end to end (`run_scenario`, `truth.json`).
- `facts`: what the fault changed, from the run's store.
- `protocol`: the eval's grids, dev/holdout splits and each case's draws; `scoring`: rows and the summary;
  `evaldir`: what an eval keeps in its directory.
- `cli` (`stepscope scenario`), `eval` (`stepscope eval`).
"""
