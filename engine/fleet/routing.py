"""Routing policies: which replica gets a request. Pure data structures; no I/O, no OpenTelemetry.

    hashes = router.hashes(prompt_ids, block_size, salt)     # chained hashes of the prompt's leading blocks
    decision = router.choose(hashes)                         # -> Decision(replica, candidates...)
    ... the request runs on decision.replica (router.started / router.finished keep the load)

prefix_aware remembers, per replica, the block hashes of the prompts it sent there (an LRU) and sends a
request to the replica holding the longest run of its leading blocks, among the replicas whose load is
within `load_slack` of the least loaded one: a hot prefix fills one replica up to that bound, then spills
to the next, which learns it too. With no match it falls back to least_loaded. Load is the router's count
of requests in flight on the replica (its waiting + running, as far as this router's traffic goes). The
router hashes runs of `hash_blocks` of the engine's KV blocks, not each block: the choice needs the
replica holding the longest prefix, not its length to the block, and every hash costs a lookup and an LRU
move on every request.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from operator import attrgetter
from typing import Literal

RoutingPolicy = Literal["round_robin", "least_loaded", "prefix_aware"]
POLICIES: tuple[str, ...] = ("round_robin", "least_loaded", "prefix_aware")


def block_hashes(prompt_ids: list[int], block_size: int, salt: str = "") -> list[int]:
    """The chained hashes of the prompt's full blocks: block k's hash covers blocks 0..k (and the cache
    salt), so two prompts share exactly the hashes of their common run of leading full blocks: the prefix
    cache's equivalence, on its block boundaries. The engine's block manager chains blake2b over the same
    blocks; the router only compares its own hashes, in its own process, so it chains Python's 64-bit
    hash of each block's token ids (~0.3 us a block against ~1.7 us for a blake2b call). `zip` cuts the
    full blocks into tuples and drops the partial last one without a slice of the prompt per block."""
    blocks = zip(*[iter(prompt_ids)] * block_size, strict=False)
    chained = accumulate(blocks, _chain, initial=hash(("#salt", salt)))
    out = list(chained)
    del out[0]  # the salt's seed
    return out


def _chain(parent: int, block: tuple[int, ...]) -> int:
    return hash((parent, block))


@dataclass(slots=True)
class RoutingConfig:
    """Every routing default lives here; `stepscope serve --routing` picks the policy."""

    policy: RoutingPolicy = "prefix_aware"
    # prefix_aware: a replica holding the prefix may carry this many more requests than the least loaded
    # one before a request goes elsewhere (SGLang's cache-aware router bounds affinity the same way).
    load_slack: int = 4
    # KV blocks per routing hash (64 tokens at the engine's 16): a match is found to within this many
    # blocks, and a decision among 64 replicas costs about half of what a hash per block did
    hash_blocks: int = 4
    max_hashes: int = 256  # a prompt's leading hashes looked at, at most: bounds a decision on long prompts
    seed: int = 0  # routing_skew's coin

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.load_slack < 0 or self.hash_blocks < 1 or self.max_hashes < 1:
            raise ValueError("load_slack must be >= 0, hash_blocks and max_hashes >= 1")


@dataclass(eq=False, slots=True)
class Replica:
    """One replica as the router sees it."""

    instance: str  # service.instance.id
    url: str = ""
    load: int = 0  # requests in flight through this router
    healthy: bool = True
    pid: int | None = None
    index_blocks: int = 1 << 16  # hashes remembered
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)  # LRU of block hashes sent here
    routed: int = 0

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks of the prompt this replica was last sent. A chained hash implies its
        whole prefix and `remember` keeps a prompt's head at least as recent as its tail, so what is held of
        a prompt is a run of leading blocks: a binary search finds its end (5 lookups for 32 blocks)."""
        blocks, lo, hi = self.blocks, 0, len(hashes)
        while lo < hi:
            mid = (lo + hi) // 2
            if hashes[mid] in blocks:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def remember(self, hashes: Sequence[int]) -> list[int]:
        """Note the blocks as the most recently sent here, tail first, so a prompt's head outlives its tail
        (as an engine's prefix cache evicts a sequence's last blocks first); returns the hashes evicted to
        make room, least recently used first."""
        blocks, to_end = self.blocks, self.blocks.move_to_end
        for h in reversed(hashes):
            try:  # most of a routed prompt is held already: one call, not a test and a call
                to_end(h)
            except KeyError:
                blocks[h] = None
        return [blocks.popitem(last=False)[0] for _ in range(len(blocks) - self.index_blocks)]


@dataclass(slots=True)
class Decision:
    """One routing decision, as the `route` span records it."""

    replica: Replica
    policy: str
    considered: list[Replica]  # every healthy replica, in the router's order
    held: dict[Replica, int]  # prefix-match hashes of the replicas holding at least the first one
    hashed: int  # the prompt's hashes
    unit: int = 1  # KV blocks per hash

    @property
    def prefix_blocks(self) -> int:
        """The prompt's KV blocks the router hashed (its full blocks, in whole hashes)."""
        return self.hashed * self.unit

    @property
    def candidates(self) -> list[tuple[str, int, int]]:
        """(instance, load, prefix-match KV blocks) of every healthy replica; the loads are the replicas'
        own, so read this before `Router.started` counts the request (the route span does)."""
        held, unit = self.held, self.unit
        return [(r.instance, r.load, held.get(r, 0) * unit) for r in self.considered]


@dataclass(slots=True)
class RouterFaults:
    """The router's faults (docs/faults.md): real changes to its decisions."""

    cache_affinity_lost: bool = False  # prefix_aware routes as round_robin
    routing_skew: float = 0.0  # this fraction of requests goes to `skew_instance` whatever its load
    skew_instance: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.cache_affinity_lost, bool):
            raise ValueError(f"cache_affinity_lost must be true or false, got {self.cache_affinity_lost!r}")
        skew = self.routing_skew
        if isinstance(skew, bool) or not isinstance(skew, (int, float)) or not 0 <= skew <= 1:
            raise ValueError(f"routing_skew must be a number in [0, 1], got {skew!r}")

    def to_dict(self) -> dict[str, object]:
        return {"cache_affinity_lost": self.cache_affinity_lost, "routing_skew": self.routing_skew}


class Router:
    """The replicas and the policy over them."""

    def __init__(self, replicas: list[Replica], config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self.replicas = replicas
        self.by_instance = {r.instance: r for r in replicas}
        self.faults = RouterFaults()
        self._next = 0
        self._rng = random.Random(self.config.seed)
        # a prompt's first block hash -> the replicas that still remember it: a decision looks only at them
        # (a membership test on every replica cost 6 us of a 10 us decision among 64)
        self._holders: dict[int, set[Replica]] = {}
        self._order = {r: i for i, r in enumerate(replicas)}

    @property
    def policy(self) -> str:
        if self.faults.cache_affinity_lost and self.config.policy == "prefix_aware":
            return "round_robin"
        return self.config.policy

    def hashes(self, prompt_ids: list[int], block_size: int, salt: str = "") -> list[int]:
        """The prompt's routing hashes: `block_hashes` over runs of `hash_blocks` KV blocks of
        `block_size` tokens, at most `max_hashes` of them."""
        tokens = block_size * self.config.hash_blocks
        most = tokens * self.config.max_hashes
        return block_hashes(prompt_ids[:most] if len(prompt_ids) > most else prompt_ids, tokens, salt)

    def choose(self, hashes: list[int], exclude: frozenset[str] = frozenset()) -> Decision | None:
        """The replica for a prompt with these block hashes (None: no healthy replica left)."""
        if exclude:
            healthy = [r for r in self.replicas if r.healthy and r.instance not in exclude]
        else:
            healthy = [r for r in self.replicas if r.healthy]
        if not healthy:
            return None
        policy = self.policy
        holders = self._holders.get(hashes[0], ()) if hashes else ()
        if len(holders) > 1:
            holders = sorted(holders, key=self._order.__getitem__)  # the router's order breaks ties
        held = {r: r.match(hashes) for r in holders if r.healthy and r.instance not in exclude}
        skew = self.faults.routing_skew
        skewed = self.by_instance.get(self.faults.skew_instance) if skew else None
        if skewed is not None and skewed in healthy and self._rng.random() < skew:
            chosen = skewed
        elif policy == "round_robin":
            chosen = healthy[self._next % len(healthy)]
            self._next += 1
        elif policy == "least_loaded" or not held:
            chosen = self._least_loaded(healthy)
        else:
            slack = self.config.load_slack
            # a holder at or under the slack is within the bound whatever the least load: the fleet-wide
            # minimum (a pass over every replica) is needed only when one is above it
            loaded = max(map(_LOAD, held)) > slack
            bound = min(map(_LOAD, healthy)) + slack if loaded else slack
            # the longest match within the load bound, then the less loaded, then the first
            within = [(r, m) for r, m in held.items() if r.load <= bound]
            chosen = max(within, key=_match_then_idle)[0] if within else self._least_loaded(healthy)
        return Decision(chosen, policy, healthy, held, len(hashes), self.config.hash_blocks)

    def started(self, decision: Decision, hashes: list[int]) -> None:
        """The request went to the chosen replica: count it, remember its blocks there."""
        r = decision.replica
        r.load += 1
        r.routed += 1
        if self.config.policy != "prefix_aware":
            return
        for h in r.remember(hashes):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(r)
                if not holders:
                    del self._holders[h]
        if hashes and hashes[0] in r.blocks:
            self._holders.setdefault(hashes[0], set()).add(r)

    def finished(self, replica: Replica) -> None:
        replica.load = max(replica.load - 1, 0)

    def _least_loaded(self, healthy: list[Replica]) -> Replica:
        """Fewest in flight; ties rotate, so an idle fleet is filled evenly."""
        low = min(map(_LOAD, healthy))
        tied = [r for r in healthy if r.load == low]
        self._next += 1
        return tied[self._next % len(tied)]


_LOAD = attrgetter("load")


def _match_then_idle(pair: tuple[Replica, int]) -> tuple[int, int]:
    return pair[1], -pair[0].load
