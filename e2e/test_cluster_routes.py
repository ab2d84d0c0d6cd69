"""The test cluster keeps its traffic on this machine (issue 37): tools/cluster/up.sh makes the
cluster's Service and pod ranges unreachable beyond the node, so a connection to a ClusterIP that no
Service holds (one just deleted) fails at once on the machine instead of leaving by the host's
default route. (tools/test.sh checks after the e2e run that tools/cluster/down.sh left no route.)
"""

from __future__ import annotations

import ipaddress

import pytest
from imesh_e2e import cluster_routes_missing, exec_python, frontend_pod, get_json

# A connection from inside a pod to an address of the Service range that no Service holds.
CONNECT = r"""
import socket, sys, time
start = time.monotonic()
try:
    socket.create_connection((sys.argv[1], 80), timeout=20).close()
    print("connected", round(time.monotonic() - start, 2))
except OSError as err:
    print(type(err).__name__, err.errno, round(time.monotonic() - start, 2))
"""


def test_the_cluster_ranges_are_unreachable_beyond_the_node(settings: dict, shared_mesh: dict) -> None:
    if not settings["containerd_address"]:
        pytest.skip("the routes are tools/cluster/up.sh's: run on its cluster's node")
    assert cluster_routes_missing() == []
    taken = {s["spec"].get("clusterIP") for s in get_json("services", "-A")["items"]}
    free = next(str(ip) for ip in ipaddress.ip_network("10.96.0.0/24").hosts() if str(ip) not in taken
                and int(str(ip).rsplit(".", 1)[1]) > 200)
    pod = frontend_pod(shared_mesh["namespace"], shared_mesh["name"])["metadata"]["name"]
    out = exec_python(shared_mesh["namespace"], pod, CONNECT, free, timeout=60)
    kind, *rest = out.stdout.split()
    # refused or unreachable, at once: not a timeout (packets dropped somewhere) and never a connection
    assert kind in ("ConnectionRefusedError", "OSError") and float(rest[-1]) < 5, out.stdout + out.stderr
