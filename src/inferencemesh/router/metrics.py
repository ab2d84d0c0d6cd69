"""The router's Prometheus metrics (its own registry), labelled by replica; a replica's series
are removed when it goes away."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "inferencemesh_router_"
REPLICA = "replica"
SCORER = "scorer"  # blocks (KV events) or characters (the fallback: no tokenizer in the router)
# The router's own work before a request leaves for its replica: tens of microseconds to a millisecond.
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
RETRY_REASONS = ("429", "502", "503", "connect", "disconnected")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(PREFIX + "requests", "Requests answered through a replica, by replica and "
                                "status class (2xx, 4xx, 5xx).", [REPLICA, "outcome"], registry=registry)
        self.retries = Counter(PREFIX + "retries", "Requests retried on the next replica, by the replica that "
                               "failed and why (its status, or connect / disconnected).", [REPLICA, "reason"],
                               registry=registry)
        self.affinity_hits = Counter(PREFIX + "prefix_affinity_hits", "Prompted requests sent first to a replica "
                                     "holding part of their prefix: by scorer, blocks (its KV cache holds the "
                                     "prompt's leading blocks) or characters (it was sent the prompt's leading "
                                     "characters before: the fallback).", [REPLICA, SCORER], registry=registry)
        self.affinity_misses = Counter(PREFIX + "prefix_affinity_misses", "Prompted requests sent first to a "
                                       "replica with no known part of their prefix, by scorer.", [REPLICA, SCORER],
                                       registry=registry)
        self.kv_blocks = Gauge(PREFIX + "replica_kv_blocks", "KV blocks the replica's cache holds, as its "
                               "KV events said last.", [REPLICA], registry=registry)
        self.in_flight = Gauge(PREFIX + "requests_in_flight", "Requests sent to a replica and not finished.",
                               [REPLICA], registry=registry)
        self.replica_waiting = Gauge(PREFIX + "replica_requests_waiting", "The replica's "
                                     "inferencemesh_num_requests_waiting, last read.", [REPLICA], registry=registry)
        self.ready_replicas = Gauge(PREFIX + "ready_replicas", "Replicas requests are sent to.", registry=registry)
        self.no_replica = Counter(PREFIX + "no_replica", "Requests answered 503 because no replica was ready.",
                                  registry=registry)
        self.overhead = Histogram(PREFIX + "overhead_seconds", "The router's time from a request's whole body to "
                                  "sending it upstream (choosing a replica included).", buckets=OVERHEAD_BUCKETS,
                                  registry=registry)
        self._labelled = (self.requests, self.retries, self.affinity_hits, self.affinity_misses, self.in_flight,
                          self.replica_waiting, self.kv_blocks)

    def remove_replica(self, name: str) -> None:
        """Drop every series of a replica that went away."""
        for metric in self._labelled:
            for labels in list(metric._metrics):  # noqa: SLF001 - prometheus_client has no query for them
                if labels[0] == name:
                    metric.remove(*labels)
