"""Streaming clients inside the cluster for as long as a change takes: a pod of its own that sends
greedy streamed completions through the mesh's Service DNS name from several threads, checks each
answer against the one expected, and counts what failed.

A port-forward reaches one pod of a Service and dies with it, so a change that replaces pods (a
rollout, a deleted router pod) is measured from inside the cluster, as a client there meets it.

    with LoadClient(ns, "imesh-e2e-load", image, pull_policy, endpoint, expected) as load:
        ...change something...
    load.result  # {"requests": n, "ok": n, "failed": [...], "mismatched": [...], ...}

A request fails when its answer is not a 200 with a complete stream (a finish reason and
`[DONE]`, no error event) or cannot be had at all; it is mismatched when its text differs from the
expected greedy text. The pod runs until the test touches its stop file, or its own time limit.
"""

from __future__ import annotations

import json
import time

from imesh_e2e import MODEL, apply, get_json, kubectl, wait_for

STOP_FILE = "/tmp/stop"

# stdlib only: it runs in the frontend image. argv: base model workers limit_s max_tokens expected_json
SCRIPT = r"""
import http.client, json, os, sys, threading, time, urllib.parse
base, model = sys.argv[1], sys.argv[2]
workers, limit, max_tokens = int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
expected = json.loads(sys.argv[6])
prompts = sorted(expected)
url = urllib.parse.urlsplit(base)
start = time.monotonic()
lock = threading.Lock()
out = {"requests": 0, "ok": 0, "failed": [], "mismatched": []}

def one(prompt):
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=300)
    try:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True})
        conn.request("POST", url.path.rstrip("/") + "/completions", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            return None, f"HTTP {reply.status}: {reply.read()[:300]!r}"
        text, finish, done = [], None, False
        for raw in reply:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                return None, f"error event: {event['error']}"
            for choice in event.get("choices") or []:
                text.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
        if not done or finish is None:
            return None, f"the stream ended without [DONE] or a finish reason (finish_reason {finish})"
        return "".join(text), None
    except Exception as err:
        return None, repr(err)
    finally:
        conn.close()

def worker(w):
    i = w
    while time.monotonic() - start < limit and not os.path.exists("/tmp/stop"):
        prompt = prompts[i % len(prompts)]
        i += workers
        text, error = one(prompt)
        at = round(time.monotonic() - start, 1)
        with lock:
            out["requests"] += 1
            if error is not None:
                out["failed"].append({"at_s": at, "error": error})
            elif text != expected[prompt]:
                out["mismatched"].append({"at_s": at, "prompt": prompt, "text": text})
            else:
                out["ok"] += 1

threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
for t in threads:
    t.start()
print("started", flush=True)
for t in threads:
    t.join()
out["seconds"] = round(time.monotonic() - start, 1)
print(json.dumps(out), flush=True)
"""


class LoadClient:
    """The load pod as a context manager: started on entry (once its threads run), stopped on exit
    (the stop file; every request in flight is awaited), its counts in .result."""

    def __init__(self, ns: str, name: str, image: str, pull_policy: str, base: str, expected: dict[str, str], *,
                 workers: int = 4, max_tokens: int = 16, limit_s: float = 1200) -> None:
        self.ns, self.name = ns, name
        container = {"name": "client", "image": image,
                     "command": ["python", "-c", SCRIPT, base, MODEL, str(workers), str(limit_s), str(max_tokens),
                                 json.dumps(expected)],
                     "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
        if pull_policy:
            container["imagePullPolicy"] = pull_policy
        self.pod = {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": name, "labels": {"app": "imesh-e2e-client"}},
                    "spec": {"restartPolicy": "Never", "containers": [container], "terminationGracePeriodSeconds": 5,
                             "securityContext": {"runAsNonRoot": True, "runAsUser": 10001}}}
        self.result: dict = {}

    def _phase(self) -> str:
        return get_json("pod", self.name, "-n", self.ns)["status"].get("phase", "")

    def __enter__(self) -> LoadClient:
        kubectl("delete", "pod", self.name, "-n", self.ns, "--ignore-not-found", "--wait=true")
        apply(self.ns, self.pod)
        wait_for(lambda: self._phase() in ("Running", "Succeeded", "Failed")
                 and "started" in kubectl("logs", "-n", self.ns, self.name, check=False), 180,
                 f"load client {self.name} to start")
        return self

    def progress(self) -> None:
        """Fails at once if the pod stopped early (it only stops by the stop file)."""
        assert self._phase() == "Running", kubectl("logs", "-n", self.ns, self.name, check=False)[-3000:]

    def __exit__(self, *exc: object) -> None:
        try:
            kubectl("exec", "-n", self.ns, self.name, "--", "python", "-c",
                    f"open({STOP_FILE!r}, 'w').close()", check=False)
            deadline = time.monotonic() + 360
            phase = wait_for(lambda: self._phase() in ("Succeeded", "Failed") and self._phase(),
                             max(1.0, deadline - time.monotonic()), f"load client {self.name} to finish")
            logs = kubectl("logs", "-n", self.ns, self.name)
            assert phase == "Succeeded", f"load client {phase}:\n{logs[-3000:]}"
            self.result = json.loads(logs.strip().splitlines()[-1])
        finally:
            kubectl("delete", "pod", self.name, "-n", self.ns, "--ignore-not-found", "--wait=false", check=False)

    def summary(self) -> str:
        r = self.result
        return (f"{r.get('requests')} requests in {r.get('seconds')} s: {r.get('ok')} ok, "
                f"{len(r.get('failed', []))} failed (first: {r.get('failed', [])[:3]}), "
                f"{len(r.get('mismatched', []))} mismatched (first: {r.get('mismatched', [])[:2]})")
