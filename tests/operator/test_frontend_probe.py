"""The mesh's status reports the strategy the frontend really runs, read from the frontend's own
/metrics: the frontend's exporter and the operator's parser are the two ends of that wire."""

from __future__ import annotations

import http.server
import threading

from inferencemesh.frontend.engine.metrics import FrontendMetrics
from inferencemesh.operator.frontend_probe import observed_strategy, parse_strategy
from inferencemesh.operator.status import speculative_status
from inferencemesh.speculation import choose_speculation


def test_the_operator_reads_what_the_frontend_exports() -> None:
    metrics = FrontendMetrics("imesh-code-target")
    metrics.set_speculative_strategy("none", "DraftUnavailable")
    text, _ = metrics.render()
    assert parse_strategy(text.decode()) == ("none", "DraftUnavailable")
    metrics.set_speculative_strategy("draft", "PackageDefault")
    assert parse_strategy(metrics.render()[0].decode()) == ("draft", "PackageDefault")
    assert parse_strategy("# nothing here\n") is None


def test_status_prefers_the_frontends_report() -> None:
    planned = choose_speculation(strategy=None, draft="/d")
    assert speculative_status(planned, None)["strategy"] == "draft"
    same = speculative_status(planned, ("draft", "Requested"))
    assert same["strategy"] == "draft" and "the frontend runs it" in same["message"]
    failed = speculative_status(planned, ("none", "DraftUnavailable"))
    assert (failed["strategy"], failed["reason"]) == ("none", "DraftUnavailable")
    assert "planned was draft" in failed["message"]


def test_observed_strategy_over_http_and_when_unreachable() -> None:
    metrics = FrontendMetrics("m")
    metrics.set_speculative_strategy("ngram", "PackageDefault")
    body = metrics.render()[0]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert observed_strategy(f"http://127.0.0.1:{server.server_port}/metrics") == ("ngram", "PackageDefault")
    finally:
        server.shutdown()
    assert observed_strategy(f"http://127.0.0.1:{server.server_port}/metrics", timeout=0.5) is None
