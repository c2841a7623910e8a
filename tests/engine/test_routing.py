"""Routing policies as pure functions of the replicas' state (engine/fleet/routing.py)."""

from __future__ import annotations

from engine.block_manager import hash_block
from engine.fleet.routing import Replica, Router, RouterFaults, RoutingConfig, block_hashes


def _router(policy: str = "prefix_aware", n: int = 3, **kw) -> Router:
    return Router([Replica(f"h:{i}") for i in range(n)], RoutingConfig(policy=policy, **kw))


def _send(router: Router, hashes: list[bytes]) -> str:
    d = router.choose(hashes)
    router.started(d, hashes)
    return d.replica.instance


def test_block_hashes_are_the_prefix_caches_chained_hashes():
    ids, parent, expected = list(range(50)), b"", []
    for i in range(3):
        parent = hash_block(parent, ids[i * 16 : (i + 1) * 16], "salty" if i == 0 else "")
        expected.append(parent)
    assert block_hashes(ids, 16, "salty") == expected


def test_prefix_aware_returns_a_prefix_to_its_replica_until_the_load_bound():
    router = _router(load_slack=2)
    a, b = block_hashes(list(range(64)), 16), block_hashes(list(range(100, 164)), 16)
    first_a, first_b = _send(router, a), _send(router, b)
    assert first_a != first_b  # no match: least loaded
    assert [_send(router, a) for _ in range(2)] == [first_a] * 2
    assert _send(router, a) != first_a  # 3 in flight there, 0 elsewhere: over the bound, it spills
    d = router.choose(a)
    assert sorted(m for _, _, m in d.candidates)[-1] == 4 and d.prefix_blocks == 4


def test_round_robin_and_least_loaded_spread_requests():
    rr = _router("round_robin")
    assert [_send(rr, []) for _ in range(4)] == ["h:0", "h:1", "h:2", "h:0"]
    ll = _router("least_loaded")
    ll.replicas[0].load, ll.replicas[1].load = 5, 1
    assert _send(ll, []) == "h:2"


def test_faults_turn_affinity_off_and_skew_traffic_to_one_replica():
    router = _router(seed=1)
    router.faults = RouterFaults(cache_affinity_lost=True)
    assert router.policy == "round_robin"
    router.faults = RouterFaults(routing_skew=0.8, skew_instance="h:2")
    picks = [_send(router, []) for _ in range(200)]
    assert picks.count("h:2") > 150


def test_no_healthy_replica_means_no_decision():
    router = _router()
    for r in router.replicas:
        r.healthy = False
    assert router.choose([]) is None
