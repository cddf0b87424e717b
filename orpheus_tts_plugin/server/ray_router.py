"""Ray Serve's request router for Orpheus replicas: each request (a stream) to the replica with the fewest of this
router's requests open, ties in turn (`routing.least_loaded`, the rule RemoteEngine's own list of servers follows).

Ray's default router (power of two choices, `_private/request_router/pow_2_router.py`) ranks two random replicas by a
cached count of their open requests, and each replica's acceptance reply overwrites that count with the replica's own
at that moment (`RequestRouter.on_new_queue_len_info`). In a burst the replies are older than the sends made in
between, and a replica whose entry went stale (10 s without a request) is passed over while another's is fresh: 8
streams started in the same instant landed 8/0 and 6/2 on two replicas. This router counts what it sent itself, from
the choice to the request's end, so a burst spreads as evenly as streams opened one by one. Each proxy (one a node)
has its own router and counts its own streams; a replica Ray's cache holds full (max_ongoing_requests) is passed
over while another is not.
"""

from __future__ import annotations

import collections
import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ..wire.routing import least_loaded

IMPORT_PATH = "orpheus_tts_plugin.server.ray_router:FewestStreamsRouter"


class StreamCounts:
    """This router's open requests by replica, from the choice of a replica to the request's end, and whose turn a tie
    is. Its own object, not attributes on the router: Ray's RequestRouter keeps private state of its own, which a
    name of ours could shadow in a later release. Owned by the router's event loop: no lock."""

    def __init__(self) -> None:
        # By internal request id: the replica chosen for it, and its pending request (until it is sent).
        self.chosen: dict[str, tuple[ReplicaID, PendingRequest | None]] = {}
        self.open: collections.Counter[ReplicaID] = collections.Counter()  # requests by replica
        self.turn = random.randrange(1 << 16)  # ties in turn, from a different replica in each proxy

    def count(self, request_id: str, replica_id: ReplicaID, pending: PendingRequest | None) -> None:
        self.uncount(request_id)  # chosen again (a retry, or a replica full after all): counted once, where it goes
        self.chosen[request_id] = (replica_id, pending)
        self.open[replica_id] += 1

    def uncount(self, request_id: str) -> None:
        replica_id, _ = self.chosen.pop(request_id, (None, None))
        if replica_id is not None:
            self.open[replica_id] -= 1
            if self.open[replica_id] <= 0:
                del self.open[replica_id]

    def forget_cancelled(self) -> None:
        """Requests cancelled while being routed are never sent, so never complete: uncount them."""
        gone = [rid for rid, (_, pending) in self.chosen.items() if pending is not None and pending.future.cancelled()]
        for request_id in gone:
            self.uncount(request_id)


class FewestStreamsRouter(RequestRouter):
    """Fewest open requests of this router first. Every method runs on the router's event loop (Ray schedules the
    completion callbacks there), which owns `stream_counts`. It overrides only RequestRouter's public methods."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.stream_counts = StreamCounts()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """The replica with the fewest open requests of this router among those Ray's cache does not hold full."""
        candidates = self.select_available_replicas(candidate_replicas) or candidate_replicas
        if not candidates:
            return []
        counts = self.stream_counts
        counts.forget_cancelled()
        counts.turn += 1
        best = least_loaded(candidates, lambda r: counts.open[r.replica_id], counts.turn)
        if pending_request is not None:
            counts.count(pending_request.metadata.internal_request_id, best.replica_id, pending_request)
        return [[best]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """A replica accepted the request (where Ray's rejection protocol is on): counted there."""
        self.stream_counts.count(pending_request.metadata.internal_request_id, replica_id, None)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request ended (finished, failed, cancelled or rejected): no longer counted."""
        self.stream_counts.uncount(internal_request_id)
