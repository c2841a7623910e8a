"""Routing policies as pure functions of the replicas' state (engine/fleet/routing.py)."""

from __future__ import annotations

from engine.fleet.routing import Replica, Router, RouterFaults, RoutingConfig, block_hashes


def _router(policy: str = "prefix_aware", n: int = 3, **kw) -> Router:
    return Router([Replica(f"h:{i}") for i in range(n)], RoutingConfig(policy=policy, **kw))


def _send(router: Router, hashes: list[int]) -> str:
    d = router.choose(hashes)
    router.started(d, hashes)
    return d.replica.instance


def test_block_hashes_are_shared_exactly_over_the_common_leading_full_blocks():
    ids = list(range(50))
    hashes = block_hashes(ids, 16, "salty")
    assert len(hashes) == 3  # full blocks only
    assert block_hashes(ids[:48] + [7, 7], 16, "salty") == hashes  # a different partial block: the same
    other = block_hashes(ids[:20] + [999] + ids[21:], 16, "salty")  # block 1 differs, so does all after
    assert other[0] == hashes[0] and other[1] != hashes[1] and other[2] != hashes[2]
    assert block_hashes(ids, 16, "other")[0] != hashes[0]  # the cache salt is part of the chain
    assert block_hashes(ids[16:32] + ids[16:32], 16, "salty")[1] != block_hashes(ids[16:32], 16, "salty")[0]


def test_prefix_aware_returns_a_prefix_to_its_replica_until_the_load_bound():
    router = _router(load_slack=2, hash_blocks=1)
    a, b = router.hashes(list(range(64)), 16), router.hashes(list(range(100, 164)), 16)
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


def test_the_router_hashes_runs_of_kv_blocks_and_reports_matches_in_kv_blocks():
    router = _router(hash_blocks=4, max_hashes=3)
    ids = list(range(1000))
    hashes = router.hashes(ids, 16)
    assert hashes == block_hashes(ids[: 3 * 64], 64)  # 64-token runs, the first 3 only
    assert router.hashes(ids[:63], 16) == []  # under one run: nothing to match, least_loaded decides
    first = _send(router, hashes)
    other = router.hashes(ids[:128] + [7] * 100, 16)  # the same first two runs, then a different third
    d = router.choose(other)
    assert d.replica.instance == first
    assert dict((i, m) for i, _, m in d.candidates)[first] == 8 and d.prefix_blocks == 12  # in KV blocks
