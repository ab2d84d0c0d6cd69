"""The grammar worker: a child process that compiles each new grammar once, where a crash or a
runaway compile costs only itself.

llguidance's compiler is native code that recurses on the grammar's structure: a crafted grammar
overflows its stack (SIGSEGV, the whole process) or compiles for minutes. So a grammar the
serving process has not seen is first compiled here, by `LLMatcher.validate_grammar`:
- on a thread with a WORKER_STACK_BYTES stack, a quarter of the serving threads' (8 MiB, Linux's
  default): a grammar that compiles here has four times the room where it is built for serving;
- within COMPILE_CPU_S seconds of CPU (RLIMIT_CPU: the kernel ends the worker with SIGXCPU, so a
  busy machine does not turn a slow wall clock into a refusal), and WALL_TIMEOUT_S of wall time;
- at the lowest CPU priority (nice 19): a grammar bomb waits for CPU the stages do not want.
A worker that dies answers that grammar's verdict (a refusal saying why) and is replaced on the
next grammar. Verdicts are cached by grammar text, so the serving process only ever builds
grammars that compiled here, and compiles each at most once here.

Protocol: one JSON line per grammar on stdin ({"grammar", "limits"}), one JSON line back
({"error": "" or the message}); EOF on stdin ends the worker. This module imports only
llguidance: the worker starts in a fraction of a second and holds no model.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import IO, Any

WORKER_STACK_BYTES = 2 * 1024 * 1024
COMPILE_CPU_S = 2  # RLIMIT_CPU counts whole seconds: 2 to 3 s of CPU
WALL_TIMEOUT_S = 30.0  # a worker starved of CPU, or stuck: refused all the same
VERDICTS = 512  # grammars whose verdict is remembered


class GrammarChecker:
    """Compiles grammars in a worker process, one at a time; thread-safe (callers block)."""

    def __init__(self, cpu_s: int = COMPILE_CPU_S, wall_s: float = WALL_TIMEOUT_S) -> None:
        self.cpu_s, self.wall_s = cpu_s, wall_s
        self._lock = threading.Lock()  # the worker: one grammar at a time
        self._verdicts_lock = threading.Lock()  # the cache: never waits for a compile
        self._proc: subprocess.Popen[bytes] | None = None
        self._verdicts: OrderedDict[str, str] = OrderedDict()
        self.compiles = 0  # grammars sent to a worker (not answered from the cache), for tests
        self.restarts = 0  # workers that died (crash or budget), for tests

    def check(self, grammar: str, limits: dict[str, Any]) -> str:
        """"" when the grammar compiles within the budget, else why not (one line)."""
        key = hashlib.sha256(json.dumps([grammar, limits], sort_keys=True).encode()).hexdigest()
        with self._verdicts_lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        with self._lock:
            with self._verdicts_lock:  # compiled while this caller waited for the worker
                if key in self._verdicts:
                    return self._verdicts[key]
            verdict, lasting = self._compile(grammar, limits)
            if lasting:  # before the next waiter looks
                with self._verdicts_lock:
                    self._verdicts[key] = verdict
                    if len(self._verdicts) > VERDICTS:
                        self._verdicts.popitem(last=False)
        return verdict

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _compile(self, grammar: str, limits: dict[str, Any]) -> tuple[str, bool]:
        """The verdict, and whether it lasts (a wall-clock timeout says as much about the
        machine's load as about the grammar: it is not remembered)."""
        proc = self._worker()
        assert proc.stdin is not None and proc.stdout is not None
        self.compiles += 1
        try:
            proc.stdin.write(json.dumps({"grammar": grammar, "limits": limits, "cpu_s": self.cpu_s}).encode() + b"\n")
            proc.stdin.flush()
            line = _read_line(proc.stdout, self.wall_s)
        except OSError:  # the worker died under the write
            line = b""
        if line:
            return str(json.loads(line)["error"]), True
        try:
            proc.wait(1.0)  # its output ended: it is dying
            timed_out = False
        except subprocess.TimeoutExpired:  # or it is still compiling
            timed_out = True
        self._stop()
        self.restarts += 1
        if timed_out:
            return f"the grammar compiler did not finish within {self.wall_s:.0f}s (the server is busy)", False
        code = proc.returncode
        if code == -signal.SIGXCPU:
            return f"the grammar takes more than {self.cpu_s}s of CPU to compile", True
        name = signal.Signals(-code).name if code < 0 and -code in signal.Signals._value2member_map_ else code
        return f"the grammar compiler failed on it ({name})", True

    def _worker(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _read_line(stream: IO[bytes], timeout: float) -> bytes:
    """One line from the worker, or b"" if it died or took longer than timeout."""
    deadline = time.monotonic() + timeout
    fd, data = stream.fileno(), b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b""
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b""
        data += chunk
    return data


_CHECKER: GrammarChecker | None = None
_CHECKER_LOCK = threading.Lock()


def checker() -> GrammarChecker:
    """This process's grammar checker (its worker starts on the first grammar)."""
    global _CHECKER
    with _CHECKER_LOCK:
        if _CHECKER is None:
            _CHECKER = GrammarChecker()
        return _CHECKER


# ---- the worker process -----------------------------------------------------------------------

def _validate(grammar: str, limits: dict[str, Any]) -> str:
    import llguidance

    try:
        return str(llguidance.LLMatcher.validate_grammar(grammar, limits=llguidance.LLParserLimits(**limits)))
    except Exception as exc:  # a malformed grammar document (not what the serving process sends)
        return str(exc) or type(exc).__name__


def _run(job: dict[str, Any], result: list[str]) -> None:
    result.append(_validate(job["grammar"], job["limits"]))


def main() -> None:
    os.nice(19)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # dying is this process's job: leave no core files
    threading.stack_size(WORKER_STACK_BYTES)
    for raw in sys.stdin.buffer:
        job = json.loads(raw)
        # The budget is this grammar's: the limit is set past what the worker has used so far.
        used = resource.getrusage(resource.RUSAGE_SELF)
        spent = int(used.ru_utime + used.ru_stime) + 1
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = spent + int(job["cpu_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        result: list[str] = []
        thread = threading.Thread(target=_run, args=(job, result))
        thread.start()
        thread.join()
        sys.stdout.write(json.dumps({"error": result[0] if result else "the grammar compiler failed"}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
