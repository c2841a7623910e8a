"""The alert state machine: one pure function per evaluation, no I/O.

    inactive --breach--> pending --breach held for `for`--> firing --clear held for `for`--> resolved
        ^                   |                                                                    |
        +---- not breach ---+                              (next evaluation) inactive or pending +

Anti-flap rule (hysteresis plus a hold on both edges):
- a *breach* is a value past the threshold (above it for latencies, error and burn rates; below it for
  throughput and goodput);
- *clear* is a value past the threshold by the rule's `hysteresis` margin on the good side (default 10%:
  a 2 s TTFT rule clears at 1.8 s), or no traffic at all in the window;
- pending needs the breach at every evaluation for `for` before it fires; any evaluation without a breach
  sends it back to inactive, so a value dancing around the threshold does not fire unless it stays above;
- firing needs *clear* at every evaluation for `for` before it resolves; a value between the clear level and
  the threshold (the band) neither resolves nor restarts anything, it only resets the recovery clock;
- too few samples (`min_requests`) is "no data": it neither fires nor resolves (and resets both clocks).
So one breach fires once, and noise around the threshold cannot alternate firing and resolved.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from alerting.rules import Rule

INACTIVE, PENDING, FIRING, RESOLVED = "inactive", "pending", "firing", "resolved"
EPSILON_S = 1e-3  # float rounding of unix seconds: 20 s held is 20 s even if it computes as 19.9999999
BREACH, BAND, CLEAR, NO_DATA = "breach", "band", "clear", "no_data"


@dataclass(frozen=True, slots=True)
class Observation:
    """What one evaluation measured for a rule: the value (None without enough data) and the sample size."""

    value: float | None
    requests: int = 0
    detail: tuple[tuple[str, float], ...] = ()  # burn rule: the burn rate of each window, and so on


@dataclass(frozen=True, slots=True)
class AlertState:
    """A rule's state between evaluations. Times are unix seconds."""

    rule: str
    state: str = INACTIVE
    active_at: float | None = None  # when the current breach was first seen (pending or firing)
    fired_at: float | None = None
    clear_since: float | None = None  # firing: when the value last became clear
    value: float | None = None
    evaluated_at: float | None = None


@dataclass(frozen=True, slots=True)
class Transition:
    """A change of state, to record in history and (firing, resolved) to notify."""

    rule: str
    old: str
    new: str
    at: float
    value: float | None
    active_at: float | None  # start of the breach; Alertmanager's startsAt
    requests: int = 0

    @property
    def notifies(self) -> bool:
        return self.new in (FIRING, RESOLVED)


def judge(rule: Rule, obs: Observation) -> str:
    """BREACH, BAND, CLEAR or NO_DATA for one observation of `rule`."""
    if rule.above and obs.requests == 0:
        return CLEAR  # no traffic: no slow request and no error
    if obs.value is None or (rule.above and obs.requests < rule.min_requests):
        return NO_DATA  # a P99 of five requests is noise
    v, t, margin = obs.value, rule.threshold, rule.hysteresis
    if rule.kind == "burn_rate":
        t = 1.0  # the value is already the burn rate over its factor, worst window pair
    if rule.above:
        return BREACH if v > t else (CLEAR if v <= t * (1 - margin) else BAND)
    return BREACH if v < t else (CLEAR if v >= t * (1 + margin) else BAND)


def step(rule: Rule, state: AlertState, obs: Observation, now: float) -> tuple[AlertState, Transition | None]:
    """Advance `state` by one evaluation at `now`. Returns the new state and the transition, if any."""
    verdict = judge(rule, obs)
    s = replace(state, value=obs.value, evaluated_at=now)
    old = state.state
    if old in (INACTIVE, RESOLVED):
        if verdict == BREACH:
            s = replace(s, state=PENDING, active_at=now, fired_at=None, clear_since=None)
            if rule.for_s <= 0:
                s = replace(s, state=FIRING, fired_at=now)
        else:
            s = replace(s, state=INACTIVE, active_at=None, fired_at=None, clear_since=None)
    elif old == PENDING:
        if verdict != BREACH:
            s = replace(s, state=INACTIVE, active_at=None)
        elif state.active_at is not None and now - state.active_at >= rule.for_s - EPSILON_S:
            s = replace(s, state=FIRING, fired_at=now)
    elif old == FIRING:
        if verdict != CLEAR:
            s = replace(s, clear_since=None)
        else:
            since = state.clear_since if state.clear_since is not None else now
            s = replace(s, clear_since=since)
            if now - since >= rule.for_s - EPSILON_S:
                s = replace(s, state=RESOLVED)
    if s.state == old or (old == RESOLVED and s.state == INACTIVE):
        return s, None
    return s, Transition(rule.name, old, s.state, now, obs.value, s.active_at, obs.requests)
