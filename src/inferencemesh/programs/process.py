"""Process plumbing every program shares: set-up, children that die with their parent, signals, ports.

Set-up. Every program (`inferencemesh serve|stage|frontend|plan|bench|operator`) is set up by the
same two calls from the CLI, so that no program decides its logging, torch threads, grad mode
or OpenMP spinning on its own: `prepare_process(program)` before torch is imported, then
`set_up_process(program, ...)` with what the program's config says (PROFILES: what differs).

Children that die with their parent. `serve` and `bench` start stage and frontend processes;
those must not outlive their parent, whatever kills it (Ctrl-C, a closed terminal, `kill -9`).
Two mechanisms, because neither alone covers every case:
- a parent-death signal (Linux prctl PR_SET_PDEATHSIG, which the child asks for first thing
  when PDEATHSIG_ENV says so): the kernel sends the child SIGTERM when the parent dies, SIGKILL
  included. Not set between fork and exec (a preexec_fn): that forces a full fork() which runs
  the at-fork handlers of a parent's gRPC in the child, and a stage child aborted there (SIGABRT,
  "epoll_wait error: Bad file descriptor") while the parent's channels were busy;
- a lifeline pipe: the parent holds the write end, the child gets the read end (its fd in
  LIFELINE_ENV) and a thread that waits for EOF, which comes when the parent is gone, on any OS.
  It also backs the signal up: a child whose graceful stop hangs exits anyway after STOP_GRACE_S.

Children. ManagedProcess is the parent's end of the lifeline and of the termination message
(below): it starts a child program with a lifeline and points the child's termination message
at a file of the parent's, from which it reads why the child exited; stop_processes stops a
group of them together. When to start, restart or stop which child is the supervisor's
(programs/supervisor.py).

Ports. A port that is taken is found before anything loads, and reported in one line that
names it (PortInUse), instead of after minutes of loading as a traceback.

Termination message. A program that exits on an error also leaves its one-line message in the
container's termination-message file (write_termination_message), where Kubernetes shows it in
the pod's status and the operator quotes it when a pipeline crash-loops.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from inferencemesh.flags import ConfigError

# The child's end of its parent's lifeline: the fd number, in the child's environment.
LIFELINE_ENV = "INFERENCEMESH_LIFELINE_FD"
# Set in the child's environment when it may ask for the parent-death signal (see supervised_popen_kwargs).
PDEATHSIG_ENV = "INFERENCEMESH_PARENT_DEATH_SIGNAL"
# How long a child whose parent died may take to stop gracefully before it exits hard.
STOP_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Where an exiting program writes why: Kubernetes' terminationMessagePath (written if it exists),
# or the file this environment variable names (created if need be).
TERMINATION_LOG_ENV = "INFERENCEMESH_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
TERMINATION_MESSAGE_BYTES = 4096  # what the kubelet reads of the file
# The command that starts a child program (`inferencemesh stage|frontend|router ...`).
CLI = [sys.executable, "-m", "inferencemesh"]
STAGE_STOP_S = 10.0  # a stage's graceful stop, SIGTERM to kill

_lifeline: tuple[int, int] | None = None  # (read end, write end), made once per parent process
_lifeline_lock = threading.Lock()


class PortInUse(ConfigError):
    """A port a program would listen on is taken; the message names it and its flag."""


class LoadFailed(Exception):  # noqa: N818 - read as "inferencemesh stage: error: ..." by its user
    """A program's model (its stage's layers, its tokenizer) could not be loaded: the program exits
    with this one line (and leaves it in the termination message), instead of staying up unready."""


# ---- set-up ---------------------------------------------------------------------------------

# How long an idle OpenMP worker spins before it sleeps. libgomp's default spin steals the
# cores of whichever process on the machine is computing: on 2 cores, llama-150m, 2 stages,
# the split ran at 0.41x one stage with the default and 0.78x with 10000 (an earlier
# measurement: 0.92x against 0.83x). Every program gets it, so bench, serve and pods measure and run
# alike; a value in the environment wins.
SPIN_ENV = "GOMP_SPINCOUNT"
DEFAULT_SPINCOUNT = "10000"
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # read once by PyTorch's CPU allocator (c10): modeling/pages.py
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


@dataclass(frozen=True)
class ProcessProfile:
    """What a program's process needs beyond the common set-up."""

    logs: bool  # timestamped INFO lines of every logger on stderr (a server's, a pod's log)
    tensors: bool  # computes with torch: no autograd, and its thread count set
    inferencemesh_level: int | None = None  # the project's loggers at this level, where `logs` is off
    quiet: tuple[str, ...] = ()  # loggers held to warnings
    # weights on 2 MiB pages (modeling/pages.py) for this program and every process it starts
    huge_pages: bool = False


PROFILES = {
    "stage": ProcessProfile(logs=True, tensors=True),
    "frontend": ProcessProfile(logs=True, tensors=True),
    # Local meshes put weights on 2 MiB pages: llama-150m float32 ÷ llama.cpp 1.21 / 1.14 / 1.45 ->
    # 1.03 / 1.08 / 1.27 (1 stage at 2 threads and 1, 2 stages). Pods leave it to their environment
    # (THP_MEM_ALLOC_ENABLE=1 opts in): one cluster run with it on everywhere failed an e2e test
    # (a frontend refusing connections after the mesh was ready), cause not established.
    "bench": ProcessProfile(logs=False, tensors=True, huge_pages=True),  # prints its results; threads per configuration
    "serve": ProcessProfile(logs=False, tensors=False, huge_pages=True),  # prints; its children log
    "plan": ProcessProfile(logs=False, tensors=False),
    # no torch in its pod; httpx's line per request (every relayed one) costs time and says nothing
    "router": ProcessProfile(logs=True, tensors=False, quiet=("httpx",)),
    # kopf logs through its own handler (kopf.configure); one line per watch event and per probe
    # drowns what matters, and errors still show.
    "operator": ProcessProfile(logs=False, tensors=False, inferencemesh_level=logging.INFO,
                               quiet=("kopf.objects", "aiohttp.access", "kopf.activities.probe")),
}


def prepare_process(program: str) -> None:
    """First thing in every program, before torch (and with it libgomp and PyTorch's allocator,
    which read their environment once) is imported: the OpenMP spin default, and for a local mesh
    (serve, bench) huge pages, for this process and every child it starts; a value already in the
    environment wins. In a child of serve or bench, the watch on its parent."""
    os.environ.setdefault(SPIN_ENV, DEFAULT_SPINCOUNT)
    if PROFILES[program].huge_pages:
        os.environ.setdefault(THP_ENV, "1")
    watch_lifeline()


def set_up_process(program: str, *, threads: int | None = None, debug: bool = False) -> None:
    """Logging, grad mode and torch threads of `program` (a PROFILES key); threads None: leave
    torch's own count (OMP_NUM_THREADS, else the machine's cores)."""
    profile = PROFILES[program]
    if profile.logs:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    if profile.inferencemesh_level is not None:
        logging.getLogger("inferencemesh").setLevel(profile.inferencemesh_level)
    if debug:
        logging.getLogger("inferencemesh").setLevel(logging.DEBUG)
    for name in profile.quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
    if profile.tensors:
        import torch

        torch.set_grad_enabled(False)
        if threads is not None:
            torch.set_num_threads(threads)


# ---- the parent's side ----------------------------------------------------------------------


def _lifeline_read_end() -> int:
    """The read end of this process's lifeline pipe (one for all its children). The write end
    stays open here, non-inheritable, until this process dies: that is the signal."""
    global _lifeline
    with _lifeline_lock:
        if _lifeline is None:
            _lifeline = os.pipe()  # both ends O_CLOEXEC: no child holds the write end
        return _lifeline[0]


def supervised_popen_kwargs(env: dict[str, str] | None = None) -> dict[str, Any]:
    """subprocess.Popen arguments for a child that dies with this process.

    The child gets its own process group (a terminal's Ctrl-C reaches only the parent, which
    relays it) but stays in the parent's session, so the whole mesh is one session to look at.
    The parent-death signal is asked for only when the main thread starts the child: the kernel
    sends it when the *thread* that forked exits, and a helper thread (a test restarting a stage)
    ends long before its parent; such children rely on the lifeline alone.
    """
    read_end = _lifeline_read_end()
    kwargs: dict[str, Any] = {
        "env": {**(os.environ if env is None else env), LIFELINE_ENV: str(read_end)},
        "pass_fds": (read_end,),
        "process_group": 0,
    }
    if threading.current_thread() is threading.main_thread():
        kwargs["env"][PDEATHSIG_ENV] = "1"
    return kwargs


_exit_notes: str | None = None


def _exit_notes_dir() -> str:
    """A private directory for this process's children's exit notes, removed when it exits."""
    global _exit_notes
    if _exit_notes is None:
        _exit_notes = tempfile.mkdtemp(prefix="inferencemesh-exits-")
        atexit.register(shutil.rmtree, _exit_notes, True)
    return _exit_notes


@dataclass
class ManagedProcess:
    """A child program, which dies with this process (supervised_popen_kwargs) and leaves the one
    line its CLI exits with (a stage that cannot load its layers: why) where exit_reason reads it:
    its termination message (write_termination_message) goes to a file of ours."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    process: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    note: str = ""  # the file its termination message goes to

    def start(self) -> None:
        if not self.note:
            self.note = os.path.join(_exit_notes_dir(), f"{self.name}-{id(self)}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.note)  # a restart's reason is its own
        env = {**os.environ, **(self.env or {}), TERMINATION_LOG_ENV: self.note}
        self.process = subprocess.Popen(self.argv, **supervised_popen_kwargs(env))
        self.started_at = time.monotonic()

    def exit_reason(self) -> str:
        """The one line it exited with (without the CLI's "inferencemesh CMD: error: "), or ''."""
        try:
            with open(self.note, encoding="utf-8", errors="replace") as f:
                line = f.read().strip()
        except OSError:
            return ""
        return re.sub(r"^inferencemesh [a-z]+: (error: )?", "", line)

    def ended(self, when: str = "") -> str:
        """How it ended, for a log line: `stage-1 exited (1){when}: why`."""
        reason = self.exit_reason()
        return f"{self.name} exited ({self.returncode}){when}" + (f": {reason}" if reason else "")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        """How the process ended (None: running, or never started)."""
        return None if self.process is None else self.process.returncode

    def terminate(self) -> None:
        """SIGTERM: a graceful stop (a frontend drains, the router finishes its streams)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL, and reap it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        self.process.wait()

    def stop(self, timeout: float = STAGE_STOP_S) -> None:
        stop_processes([self], timeout)


def stop_processes(processes: list[ManagedProcess], timeout: float,
                   hurry: Callable[[], bool] = lambda: False) -> None:
    """Stop `processes` together: SIGTERM to each that runs, then wait until all have exited; those
    still running after `timeout` seconds, or once `hurry()` is true, are killed. Returns once every
    one has exited."""
    running = [proc for proc in processes if proc.alive()]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + timeout
    while any(proc.alive() for proc in running) and time.monotonic() < deadline and not hurry():
        time.sleep(0.05)
    for proc in running:
        proc.kill()


# ---- the child's side -----------------------------------------------------------------------


def watch_lifeline() -> None:
    """In a child started with supervised_popen_kwargs: stop (SIGTERM to itself, then a hard exit
    after STOP_GRACE_S) once the parent's lifeline reaches EOF. No-op for a process nobody
    supervises (a pod, a user's shell)."""
    if os.environ.pop(PDEATHSIG_ENV, None) and sys.platform.startswith("linux"):
        _ask_for_parent_death_signal()
    fd_text = os.environ.pop(LIFELINE_ENV, None)  # popped: this process's own children are not ours to watch
    if not fd_text:
        return
    try:
        fd = int(fd_text)
        os.set_inheritable(fd, False)
    except (ValueError, OSError):
        return

    def watch() -> None:
        while True:
            try:
                if not os.read(fd, 1):  # EOF: every write end closed, the parent is gone
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(STOP_GRACE_S)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def _ask_for_parent_death_signal() -> None:
    """SIGTERM from the kernel when the parent thread that started this process dies. Asked
    after exec, so a parent that died before this line is not noticed here: its lifeline is
    at EOF already, and the watcher stops this process."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def on_stop_signals(handler: Callable[[int, Any], None]) -> None:
    """Install `handler` for every signal that asks a program to stop: SIGINT, SIGTERM, and
    SIGHUP (a closed terminal), which stops a program as SIGTERM does."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, handler)


def exit_on_stop_signals() -> None:
    """For a program with nothing to stop but its own frames (bench): SIGTERM and SIGHUP raise
    SystemExit as Ctrl-C raises KeyboardInterrupt, so `finally` blocks stop its children."""
    def leave(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGHUP, leave)


def relay_hangup_as_terminate() -> None:
    """For a program whose server installs its own SIGTERM handler later (uvicorn does, when it
    starts serving): a SIGHUP becomes a SIGTERM to this process, and meets whatever handles
    SIGTERM by then (before that, the default: exit)."""
    signal.signal(signal.SIGHUP, lambda _signum, _frame: os.kill(os.getpid(), signal.SIGTERM))


# ---- the termination message ----------------------------------------------------------------


def write_termination_message(message: str) -> None:
    """Write `message` (one line: whitespace runs become one space) to the termination-message
    file: $INFERENCEMESH_TERMINATION_LOG, else /dev/termination-log where it exists (a container's).
    Best effort: a file that cannot be written is skipped, silently."""
    path = os.environ.get(TERMINATION_LOG_ENV) or DEFAULT_TERMINATION_LOG
    line = " ".join(message.split()).encode("utf-8", "replace")[:TERMINATION_MESSAGE_BYTES - 1]
    try:
        if path == DEFAULT_TERMINATION_LOG and not os.path.exists(path):
            return
        with open(path, "wb") as out:
            out.write(line.decode("utf-8", "ignore").encode() + b"\n")
    except Exception:  # noqa: BLE001, S110 - never fail an exit for its message
        pass


# ---- ports ----------------------------------------------------------------------------------


def check_ports(ports: Iterable[tuple[str, str, int]]) -> None:
    """PortInUse for the first (what, host, port) that cannot be listened on now; port 0 (pick
    one) is skipped. Bound with SO_REUSEADDR, as the servers bind, so a port in TIME_WAIT is free."""
    for what, host, port in ports:
        if not port:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host or "0.0.0.0", port))  # noqa: S104 - probed, closed at once
            except OSError as err:
                reason = "already in use" if err.errno == errno.EADDRINUSE else err.strerror
                raise PortInUse(f"{what} port {port} on {host or '0.0.0.0'} is not available ({reason})") from err


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reachable_address(host: str) -> str:
    """The address to ask for a server listening on `host` (a wildcard host: loopback)."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104 - compared


def accepting(host: str, port: int) -> bool:
    """Whether something listens on host:port now (a wildcard host: asked on loopback)."""
    try:
        with socket.create_connection((reachable_address(host), port), timeout=1.0):
            return True
    except OSError:
        return False
