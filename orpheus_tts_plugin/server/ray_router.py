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

from .routing import least_loaded

IMPORT_PATH = "orpheus_tts_plugin.server.ray_router:FewestStreamsRouter"


class FewestStreamsRouter(RequestRouter):
    """Fewest open requests of this router first. Every method runs on the router's event loop (Ray schedules the
    completion callbacks there), so the counts need no lock."""

    def initialize_state(self, **kwargs: Any) -> None:
        # By internal request id: the replica chosen for it, and its pending request (until it is sent).
        self._chosen: dict[str, tuple[ReplicaID, PendingRequest | None]] = {}
        self._open: collections.Counter[ReplicaID] = collections.Counter()  # this router's requests by replica
        self._turn = random.randrange(1 << 16)  # ties in turn, from a different replica in each proxy

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """The replica with the fewest open requests of this router among those Ray's cache does not hold full."""
        candidates = self.select_available_replicas(candidate_replicas) or candidate_replicas
        if not candidates:
            return []
        self._forget_cancelled()
        self._turn += 1
        best = least_loaded(candidates, lambda r: self._open[r.replica_id], self._turn)
        if pending_request is not None:
            self._count(pending_request.metadata.internal_request_id, best.replica_id, pending_request)
        return [[best]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """A replica accepted the request (where Ray's rejection protocol is on): counted there."""
        self._count(pending_request.metadata.internal_request_id, replica_id, None)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request ended (finished, failed, cancelled or rejected): no longer counted."""
        self._uncount(internal_request_id)

    def _count(self, request_id: str, replica_id: ReplicaID, pending: PendingRequest | None) -> None:
        self._uncount(request_id)  # chosen again (a retry, or a replica full after all): counted once, where it goes
        self._chosen[request_id] = (replica_id, pending)
        self._open[replica_id] += 1

    def _uncount(self, request_id: str) -> None:
        replica_id, _ = self._chosen.pop(request_id, (None, None))
        if replica_id is not None:
            self._open[replica_id] -= 1
            if self._open[replica_id] <= 0:
                del self._open[replica_id]

    def _forget_cancelled(self) -> None:
        """Requests cancelled while being routed are never sent, so never complete: uncount them."""
        gone = [rid for rid, (_, pending) in self._chosen.items() if pending is not None and pending.future.cancelled()]
        for request_id in gone:
            self._uncount(request_id)
