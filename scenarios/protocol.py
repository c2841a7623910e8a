"""The eval's protocol: the cases a grid holds, their split, and each case's draws from its seed.

    grid(list(FAULTS), "full", ("dev", "holdout"))   # every fault x 2 magnitudes x 2 seeds, healthy runs
    grid(["overload"], "quick", ("dev",))            # one case at the fault's default, healthy runs

- **full**: each fault at two magnitudes x two seeds, one `dev` and one `holdout`. Magnitude k of 2 is
  drawn uniformly from the k-th half of the fault's range (`faults.value_range`; integer bounds draw
  integers), the onset uniformly from `ONSET_RANGE` of the run, the load fraction uniformly from
  `LOAD_RANGE` of the capacity where the run's demand is the open-loop rate (closed-loop demand has none).
  Healthy runs under every distinct workload of the chosen faults (the same closed-loop clients,
  documents, system prompt and engine settings, with no switch) plus the default load, at both seeds.
- **quick**: each fault once at its default magnitude, the onset at half the run and the default load
  fraction (`ScenarioConfig`'s), plus healthy runs under the default workload and one other; dev only.

**The split rule**: a case's split is its seed's. Seeds below `HOLDOUT_FROM_SEED` are `dev`: rules and
thresholds may be tuned on them. Seeds from it up are `holdout`: for reporting only, never looked at
while tuning. Every draw comes from `random.Random("<fault>/<workload>/<k>/<seed>")`, so a case is
reproducible from its seed, and a holdout case's magnitude, onset and load are as unseen as its seed.

**Traffic**: each drawn case also draws its own traffic seed (the run's workload and arrival times). With
the split's seed as every case's traffic seed, all the cases of a split replayed one arrival sequence:
one Poisson burst in its baseline then stood in every case's baseline, and the split's figure measured
that sequence as much as the diagnosis. `PROTOCOL_VERSION` names this rule in an eval's directory, so a
sitting never resumes an eval drawn under another.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

from scenarios.faults import FAULTS, open_loop, value_range

GRIDS = ("quick", "full")
SPLITS = ("dev", "holdout")
HOLDOUT_FROM_SEED = 1000
PROTOCOL_VERSION = 2  # 2: a traffic seed drawn per case (1: the split's seed for every case)
FAULT_SEEDS = {"dev": 1, "holdout": 1001}
HEALTHY_SEEDS = {"dev": 100, "holdout": 1100}
MAGNITUDES = 2  # per fault and seed in the full grid
ONSET_RANGE = (0.3, 0.7)  # of the run
LOAD_RANGE = (0.25, 0.55)  # of the calibrated capacity, for open-loop demand
DEFAULT_WORKLOAD = "default"
# The rule that should win for each injected fault, where it is not named as the fault is.
EXPECTED_CAUSE = {
    "overload": "queueing_overload",
    "cpu_contention": "compute_slowdown",
    "frontend_cpu": "frontend_bottleneck",
    "replica_slow": "compute_slowdown",  # the slowdown, on that replica
    "replica_down": "lost_capacity",
    "routing_skew": "routing_imbalance",
}
# Fleet faults run on 3 replicas of the tiny model (they fit two cores), aimed at replica 0; their top
# finding must also say where: on that one instance, or fleet-wide (`expected_scope`).
FLEET = {"replicas": 3, "model": "tiny", "fault_instance": 0}
FLEET_WIDE = ("cache_affinity_lost",)


def is_fleet(fault: str | None) -> bool:
    """Whether `fault` needs a fleet (`--replicas`)."""
    return fault in FAULTS and FAULTS[fault].fleet


def expected_scope(fault: str | None) -> str | None:
    """`fleet` or `instances` for a fleet fault's top finding; None for the others."""
    if not is_fleet(fault):
        return None
    return "fleet" if fault in FLEET_WIDE else "instances"


def split_of(seed: int) -> str:
    """`dev` or `holdout`: the split rule."""
    return "holdout" if seed >= HOLDOUT_FROM_SEED else "dev"


def expected_cause(fault: str) -> str:
    """The cause the diagnosis should name for `fault`."""
    return EXPECTED_CAUSE.get(fault, fault)


@dataclass(frozen=True, slots=True)
class Case:
    """One scenario run of the grid, with its draws."""

    fault: str | None  # None: a healthy run
    seed: int
    index: int = 0  # which of the fault's magnitudes (full grid)
    value: float | None = None
    onset_fraction: float = 0.5  # of the run (a healthy run: where the baseline mode splits it)
    load_fraction: float | None = None  # of capacity; None: closed-loop demand
    workload: str = DEFAULT_WORKLOAD  # the fault whose workload the run has, or `default`
    drawn: bool = True  # False: the quick grid's fixed point
    without_rule: str | None = None  # the cause whose rule is switched off: the case must be unexplained
    traffic_seed: int | None = None  # the run's workload and arrival seed; None: `seed`

    @property
    def run_seed(self) -> int:
        """The seed the scenario runs with (its prompts, lengths and arrival times)."""
        return self.seed if self.traffic_seed is None else self.traffic_seed

    @property
    def name(self) -> str:
        if self.fault is None:
            return f"healthy-{self.workload}-s{self.seed}"
        return f"{self.fault}-m{self.index}-s{self.seed}" if self.drawn else f"{self.fault}-s{self.seed}"

    @property
    def split(self) -> str:
        return split_of(self.seed)

    @property
    def expected(self) -> str | None:
        if self.fault is None:
            return None
        return "unexplained" if self.without_rule else expected_cause(self.fault)

    @property
    def result_file(self) -> str:
        return f"result-without-{self.without_rule}.json" if self.without_rule else "result.json"

    def to_json(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Case:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})  # type: ignore[arg-type]


def draw(fault: str | None, index: int, seed: int, workload: str = DEFAULT_WORKLOAD) -> Case:
    """The full grid's case `index` of `fault` (None: healthy under `workload`) at `seed`."""
    rng = random.Random(f"{fault or 'healthy'}/{workload}/{index}/{seed}")
    u_value, u_onset, u_load = rng.random(), rng.random(), rng.random()  # always these, in this order
    traffic_seed = rng.randrange(1, 2**31)
    value = None
    span = value_range(FAULTS[fault]) if fault else None
    if span is not None:
        lo, hi = span
        width = (hi - lo) / MAGNITUDES
        raw = lo + width * (index + u_value)
        value = float(round(raw)) if all(isinstance(b, int) for b in span) else round(raw, 3)
    setting = fault or (None if workload == DEFAULT_WORKLOAD else workload)
    is_open = setting is None or open_loop(FAULTS[setting])
    return Case(
        fault=fault,
        seed=seed,
        index=index,
        value=value,
        onset_fraction=round(_between(ONSET_RANGE, u_onset), 3),
        load_fraction=round(_between(LOAD_RANGE, u_load), 3) if is_open else None,
        workload=fault or workload,
        traffic_seed=traffic_seed,
    )


def _between(bounds: tuple[float, float], u: float) -> float:
    return bounds[0] + (bounds[1] - bounds[0]) * u


def healthy_workloads(faults: list[str]) -> dict[str, list[str]]:
    """The distinct workloads of `faults` (their documents, system prompt, closed-loop clients, engine
    options and whether they run on a fleet): name -> the faults that share it. The default workload
    comes first, always; a fleet fault's healthy runs are fleets of the same size (`FLEET`)."""
    by_setting: dict[tuple[object, ...], str] = {}
    out: dict[str, list[str]] = {DEFAULT_WORKLOAD: []}
    for name in faults:
        f = FAULTS[name]
        key = (tuple(sorted((k, repr(v)) for k, v in f.workload.items())), f.clients, f.serve_args, f.fleet)
        if key == ((), None, (), False):
            out[DEFAULT_WORKLOAD].append(name)
            continue
        label = by_setting.setdefault(key, name)
        out.setdefault(label, []).append(name)
    return out


def grid(faults: list[str], kind: str, splits: tuple[str, ...] = SPLITS) -> list[Case]:
    """The cases of grid `kind` for `faults` in `splits` (healthy runs last)."""
    if kind == "quick":
        return _quick(faults) if "dev" in splits else []
    cases = [
        draw(name, k, FAULT_SEEDS[split], name)
        for name in faults
        for split in splits
        for k in range(MAGNITUDES)
    ]
    for workload in healthy_workloads(faults):
        cases += [draw(None, 0, HEALTHY_SEEDS[split], workload) for split in splits]
    return cases


def _quick(faults: list[str]) -> list[Case]:
    from scenarios.config import ScenarioConfig

    defaults = {f.name: f.default for f in fields(ScenarioConfig)}
    seed = FAULT_SEEDS["dev"]

    def fixed(fault: str | None, workload: str) -> Case:
        setting = fault or (None if workload == DEFAULT_WORKLOAD else workload)
        is_open = setting is None or open_loop(FAULTS[setting])
        return Case(
            fault=fault,
            seed=seed if fault else HEALTHY_SEEDS["dev"],
            value=FAULTS[fault].default if fault else None,
            onset_fraction=defaults["onset_fraction"],
            load_fraction=defaults["load_fraction"] if is_open else None,
            workload=workload,
            drawn=False,
        )

    # Healthy: the default workload and one other, a closed-loop one where there is (a busy batch is
    # where a finding on a healthy run is likeliest).
    others = [w for w in healthy_workloads(faults) if w != DEFAULT_WORKLOAD]
    busy = [w for w in others if not open_loop(FAULTS[w])]
    healthy = [DEFAULT_WORKLOAD, *(busy or others)[:1]]
    return [fixed(name, name) for name in faults] + [fixed(None, w) for w in healthy]


def resolve_only(names: list[str]) -> list[str]:
    """Faults named by `--only`: fault names or the causes they are expected to produce, in table order.
    ValueError naming the unknown ones."""
    wanted: set[str] = set()
    unknown = []
    for name in names:
        hits = [f for f in FAULTS if name in (f, expected_cause(f))]
        if not hits:
            unknown.append(name)
        wanted.update(hits)
    if unknown:
        raise ValueError(f"unknown fault or cause {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
    return [f for f in FAULTS if f in wanted]
