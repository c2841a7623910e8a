"""Serving a fleet: N colocated replicas behind one router (`stepscope serve --replicas N`).

routing.py  the policies (round_robin, least_loaded, prefix_aware) as pure data structures
router.py   the router's HTTP front: pick a replica, open the `route` span, proxy, retry
launch.py   start the replica processes and the router (docs/fleet.md)
"""
