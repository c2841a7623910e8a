"""lost_capacity: an instance that served in the baseline stopped serving (killed, crashed, drained).

Evidence: its request rate fell to `lost_instance_share` of the baseline or less while the others kept
serving; what it carried moved to its peers (their load rose) or failed. Runs whether or not a symptom
regressed: a fleet that absorbs a lost replica still lost it.
"""

from __future__ import annotations

import math

from diagnosis.facts import Facts
from diagnosis.fleet import request_shares
from diagnosis.records import Evidence, Finding

CAUSE = "lost_capacity"
LEVER = (
    "Bring the instance back (its logs and exit status say why it stopped) or replace it; until then the "
    "others carry its load: check their headroom."
)


def evaluate(facts: Facts) -> Finding | None:
    loc = facts.fleet
    if loc is None or not loc.lost or len(loc.rows) < 2:
        return None
    shares = request_shares(loc)
    lost_share = sum(shares[n][0] for n in loc.lost)
    evidence = [
        Evidence(f"requests[{n}]", loc.side(n, 0, "requests"), loc.side(n, 1, "requests")) for n in loc.lost
    ]
    peers = [n for n in loc.rows if n not in loc.lost]
    evidence += [Evidence(f"request_share[{n}]", *shares[n]) for n in peers]
    evidence.append(Evidence("errors", facts.req_baseline("errors"), facts.req_current("errors")))
    symptoms = tuple(r.metric for r in facts.regressions)
    # its last request: the fleet's request series shows nothing when its peers absorb the load
    stopped = loc.stopped()
    onset = stopped if math.isfinite(stopped) else facts.onset("requests")
    names = ", ".join(loc.lost)
    return Finding(
        cause=CAUSE,
        symptoms=symptoms,
        confidence=0.95,
        onset=onset,
        evidence=tuple(evidence),
        lever=LEVER,
        sql="",
        summary=f"{names} stopped serving: {lost_share:.0%} of the fleet's requests moved to "
        f"{len(peers)} remaining instances",
        share_explained=None,
        scope={"kind": "instances", "instances": list(loc.lost), "share_of_regression": round(lost_share, 3)},
    )
