"""What a running frontend says it does, read from its own telemetry.

The mesh's status must report the speculative strategy the frontend really runs, not only the
one the operator predicted: a declared draft can fail to load, and then the frontend serves
without speculation. The frontend exports its decision as `inferencemesh_speculative_strategy_info`
on /metrics, which needs no API key (scrapers read it), so the operator reads the same series.
"""

from __future__ import annotations

import logging
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("inferencemesh.operator")
STRATEGY_METRIC = "inferencemesh_speculative_strategy_info"


def parse_strategy(metrics_text: str) -> tuple[str, str] | None:
    """(strategy, reason) of the series whose value is 1, or None."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name != STRATEGY_METRIC:
            continue
        for sample in family.samples:
            if sample.value == 1 and "strategy" in sample.labels:
                return sample.labels["strategy"], sample.labels.get("reason", "")
    return None


def observed_strategy(metrics_url: str, timeout: float = 2.0) -> tuple[str, str] | None:
    """The frontend's (strategy, reason), or None when it cannot be asked (not reachable from
    here, e.g. an operator running outside the cluster): the status then keeps the plan's."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout) as response:  # noqa: S310 - an http URL we built
            return parse_strategy(response.read().decode("utf-8", "replace"))
    except (OSError, ValueError) as err:
        log.debug("cannot read %s: %s", metrics_url, err)
        return None
