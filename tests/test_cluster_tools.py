"""tools/cluster's host changes, without root side effects: the functions of lib.sh and down.sh run
in bash against stand-ins for `ip`, `iptables*`, `modprobe` and `rmmod` (one Python program that
keeps the routes and tables in a JSON file), so the logic is checked here and the commands it
issues are the ones the real tools would get. On the cluster itself: e2e's imesh_e2e
cluster_routes_missing() while it is up, and down.sh's own check of what it left (it exits 1 naming
it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "tools" / "cluster"

# argv[0] names the tool; the state: {"routes": [...], "tables": {cmd: {table: [rule, ...]}}, "names": {...}}.
STAND_IN = r'''
import json, os, sys
tool, args = os.path.basename(sys.argv[0]), sys.argv[1:]
path = os.environ["FAKE_NET"]
state = json.load(open(path))
state.setdefault("calls", []).append([tool, *args])

def save(code=0):
    json.dump(state, open(path, "w"))
    sys.exit(code)

if tool == "ip":
    if args[:2] == ["link", "show"]:
        save(0 if args[2] in state.get("links", []) else 1)
    verb, rest = args[1], args[2:]
    if verb == "show":  # route show type unreachable CIDR
        for r in state["routes"]:
            if r.split()[1] == rest[-1] and r.startswith(rest[1]):
                print(r)
        save()
    route = " ".join(rest)
    if verb == "replace":
        if route not in state["routes"]:
            state["routes"].append(route)
        save()
    if verb == "del":
        if route not in state["routes"]:
            print("RTNETLINK answers: No such process", file=sys.stderr)
            save(2)
        state["routes"].remove(route)
        save()
    save(1)
if tool in ("modprobe", "rmmod"):
    module = args[-1]
    family, table = ("6", module[len("ip6table_"):]) if module.startswith("ip6table_") else \
        ("4", module[len("iptable_"):])
    state["names"][family].remove(table)
    open(state["names_files"][family], "w").write("".join(t + "\n" for t in state["names"][family]))
    del state["tables"]["iptables-legacy" if family == "4" else "ip6tables-legacy"][table]
    save()
# iptables, ip6tables, iptables-legacy, ip6tables-legacy: -w -t TABLE (-S | -D ... | -F CHAIN | -X CHAIN)
table, op, rest = args[2], args[3], args[4:]
rules = state["tables"].get(tool, {}).get(table)
if rules is None:
    save(1)
if op == "-S":
    print("\n".join(rules))
elif op == "-D":
    rules.remove(" ".join(["-A", *rest]))
elif op == "-F":
    rules[:] = [r for r in rules if not r.startswith(f"-A {rest[0]} ")]
elif op == "-X":
    rules.remove(f"-N {rest[0]}")
save()
'''
TOOLS = ("ip", "iptables", "ip6tables", "iptables-legacy", "ip6tables-legacy", "modprobe", "rmmod")


@pytest.fixture
def host(tmp_path: Path) -> dict:
    """A stand-in host: the tools in a bin directory ahead of PATH, and their state."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = tmp_path / "stand_in.py"
    program.write_text(STAND_IN)
    for tool in TOOLS:  # the tool's name reaches the program as its argv[0]: a link named after it
        link = tmp_path / "links" / tool
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(program)
        (bin_dir / tool).write_text(f"#!/bin/sh\nexec {sys.executable} -S -E {link} \"$@\"\n")  # -S: starts fast
        (bin_dir / tool).chmod(0o755)
    names = {"4": tmp_path / "ip_tables_names", "6": tmp_path / "ip6_tables_names"}
    state = {"routes": [], "links": [], "tables": {}, "names": {"4": [], "6": []},
             "names_files": {k: str(v) for k, v in names.items()}}
    return {"dir": tmp_path, "bin": bin_dir, "state": tmp_path / "net.json", "names": names, "initial": state}


def run(host: dict, script: str, state: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """Source down.sh (and so lib.sh) and run `script` against the stand-in host."""
    state = state or host["initial"]
    for family, path in host["names"].items():
        path.write_text("".join(t + "\n" for t in state["names"][family]))
    host["state"].write_text(json.dumps(state))
    d = host["dir"]
    env = {**os.environ, "PATH": f"{host['bin']}:/usr/bin:/bin", "FAKE_NET": str(host["state"]),
           "IMESH_CLUSTER_SNAPSHOTTER": "native", "IMESH_CACHE": str(d / "cache"),
           "IMESH_CLUSTER_STATE": str(d / "state"), "IMESH_CLUSTER_RUN": str(d / "run")}
    prelude = (f"source {CLUSTER / 'down.sh'}; LEGACY_TABLES_4={host['names']['4']}; "
               f"LEGACY_TABLES_6={host['names']['6']}; APT_SOURCE={d / 'apt.sources'}; CNI_LOCK={d / 'cni.lock'}; ")
    proc = subprocess.run(["bash", "-c", prelude + script], env=env, capture_output=True, text=True, timeout=60)
    return proc, json.loads(host["state"].read_text())


def test_up_makes_the_cluster_ranges_unreachable_and_down_takes_the_routes_away(host: dict) -> None:
    proc, state = run(host, "add_unreachable_routes; add_unreachable_routes; missing_unreachable_routes; "
                            "echo ---; remove_unreachable_routes; missing_unreachable_routes")
    assert proc.returncode == 0, proc.stderr
    before, after = proc.stdout.split("---\n")
    assert before == ""  # both there while the cluster is up (added twice: still one each)
    assert after.split() == ["10.96.0.0/24", "10.244.0.0/24"]  # the Service range, the pod range: gone
    replaced = [c for c in state["calls"] if c[:3] == ["ip", "route", "replace"]]
    assert replaced[0] == ["ip", "route", "replace", "unreachable", "10.96.0.0/24", "metric", "4242"]
    assert replaced[1] == ["ip", "route", "replace", "unreachable", "10.244.0.0/24", "metric", "4242"]
    assert state["routes"] == []


def test_down_clears_its_chains_then_unloads_only_the_empty_legacy_tables(host: dict) -> None:
    state = dict(host["initial"])
    empty = ["-P INPUT ACCEPT", "-P FORWARD ACCEPT", "-P OUTPUT ACCEPT"]
    state["names"] = {"4": ["filter", "nat", "mangle"], "6": ["raw"]}
    state["tables"] = {
        "iptables": {t: list(empty) for t in ("filter", "nat", "mangle", "raw")},
        "ip6tables": {t: list(empty) for t in ("filter", "nat", "mangle", "raw")},
        "iptables-legacy": {
            "filter": list(empty),  # empty: unloaded
            # the cluster's chain and the jump to it: cleared, then the table is empty
            "nat": ["-P PREROUTING ACCEPT", "-P OUTPUT ACCEPT", "-N KUBE-MARK-DROP",
                    "-A OUTPUT -j KUBE-MARK-DROP", "-A KUBE-MARK-DROP -j MARK --set-xmark 0x8000/0x8000"],
            "mangle": ["-P INPUT ACCEPT", "-A INPUT -p tcp -j ACCEPT"],  # someone else's rule: kept
        },
        "ip6tables-legacy": {"raw": ["-P PREROUTING DROP"]},  # a policy of someone's: kept
    }
    proc, after = run(host, "clean_iptables; unload_empty_legacy_tables", state)
    assert proc.returncode == 0, proc.stderr
    assert [c for c in after["calls"] if c[0] in ("modprobe", "rmmod")] == [
        ["modprobe", "-r", "iptable_filter"], ["modprobe", "-r", "iptable_nat"]]
    assert after["names"] == {"4": ["mangle"], "6": ["raw"]}
    # A legacy table that was not loaded is never asked about (asking would load it).
    assert not [c for c in after["calls"] if c[0] == "iptables-legacy" and c[3] == "raw"]


def test_down_removes_its_host_files_and_names_what_is_left(host: dict) -> None:
    d = host["dir"]
    (d / "apt.sources").write_text("Types: deb-src\n")
    (d / "cni.lock").write_text("")
    state = dict(host["initial"], routes=["unreachable 10.96.0.0/24 metric 4242"], links=["imesh0"])
    proc, _ = run(host, "leftovers; echo ---; remove_host_files; leftovers", state)
    assert proc.returncode == 0, proc.stderr
    before, after = proc.stdout.split("---\n")
    assert before.splitlines() == ["route: unreachable 10.96.0.0/24", "link: imesh0",
                                   f"file: {d / 'apt.sources'}", f"file: {d / 'cni.lock'}"]
    assert after.splitlines() == ["route: unreachable 10.96.0.0/24", "link: imesh0"]
    assert not (d / "apt.sources").exists() and not (d / "cni.lock").exists()


def test_the_scripts_parse_and_run_nothing_when_sourced(host: dict) -> None:
    for script in ("up.sh", "down.sh", "lib.sh"):
        assert subprocess.run(["bash", "-n", str(CLUSTER / script)], capture_output=True).returncode == 0
    proc, state = run(host, f"source {CLUSTER / 'up.sh'}; declare -F add_unreachable_routes setup_node_network")
    assert proc.returncode == 0 and proc.stdout.split() == ["add_unreachable_routes", "setup_node_network"]
    assert state.get("calls", []) == []  # sourcing ran nothing
