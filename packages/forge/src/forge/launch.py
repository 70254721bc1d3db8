"""forge's local launcher: ``nproc`` ranks on this machine; rank 0's result, or one line.

Provides :func:`launch_local`, :func:`failure_line` and the errors :class:`RankFailed` and
:class:`Interrupted`. No torch import: the launcher only starts and watches processes.

Why not torch's elastic launcher, which forge used before: three things it does that forge must
not do, none of which can be changed from outside it.

- A rank that returned waits until the launcher has read every rank's result
  (``queue_finished_reading_event``). After a signal the elastic launcher reads none (it is
  shutting down), so ranks that had saved waited out its kill timeout; and a rank that left that
  wait by itself (forge had a 2 s ``os._exit`` timer) left the launcher's
  ``multiprocessing.Event.set()`` waiting forever for a sleeper that no longer exists: the hang
  when one rank got SIGTERM and rank 0 finished its save more than 2 s after the others. Here a
  rank sends its result through a pipe of its own and exits; nobody waits on anybody.
- A rank's error travels as a JSON file under the log directory: on a full disk that file is cut
  short and the launcher dies in a JSONDecodeError. Here the message travels through the pipe.
- A signal to the launcher makes it stop reading results. Here the launcher passes SIGTERM /
  SIGINT on to the ranks and goes on reading: the ranks finish their step, save and return, and
  the run ends like any other (a second signal kills them at once).

Ranks start from a forkserver that has imported torch and the job's module once. Rank 0 keeps
the terminal; ranks >= 1 write to ``<log_dir>/<run id>/attempt_0/<rank>/{stdout,stderr}.log``.
Every rank dies with the launcher, however the launcher dies (:func:`_die_with_launcher`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection as mpc
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Interrupted", "RankFailed", "RankFailure", "failure_line", "launch_local"]

#: Once a rank has failed, how long the others have to stop by themselves (a rank that lost its
#: peer fails at its next collective, and says so) before they are killed.
STRAGGLER_GRACE_S = 5.0
#: Once a signal came, how long the ranks have to finish their step and save before they are
#: killed (a second signal kills them at once).
SHUTDOWN_GRACE_S = 300.0
#: Once every rank has sent its result, how long they have to exit before they are killed.
EXIT_GRACE_S = 30.0


class RankFailed(RuntimeError):
    """A rank failed; the message is one line (:func:`failure_line`)."""


class Interrupted(RuntimeError):
    """The launcher got a signal (the message: its name) and the ranks did not all finish."""


@dataclass(frozen=True)
class RankFailure:
    """How one rank ended without a result."""

    rank: int
    exitcode: int  # negative: killed by that signal
    message: str  # its error on one line; "" when it died without saying
    timestamp: float  # when the launcher learned of it
    error_file: str | None = None  # its traceback (rank 0: its output is the terminal)
    stopped_by_launcher: bool = False  # killed after another rank failed: never the cause

    def signal_name(self) -> str:
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"


#: Errors a rank raises because another rank died (its socket closed): never the cause.
_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|remote worker|Broken pipe", re.I)


def _one_line(text: str) -> str:
    """A rank's error message on one line (an embedded traceback: its first and last lines)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and any(line.startswith("Traceback") for line in lines):
        return f"{lines[0]} ... {lines[-1]}"
    return " ".join(lines)


def failure_line(failures: dict[int, Any], log_root: Path, run_id: str = "*") -> str:
    """One line for a failed launch: the rank whose failure caused it, its exit code or signal,
    its message, and where its full output is (``failures``: rank -> :class:`RankFailure`, or
    anything with its fields; the launch's logs are under ``log_root/<run_id>_*``).

    The cause: a rank that was not stopped by the launcher, killed by a signal, else one whose
    error is not a lost connection to a dead peer, else the earliest failure.
    """

    def message(failure: Any) -> str:
        text = failure.message
        return _one_line(text.get("message", "") if isinstance(text, dict) else str(text))

    rank, first = min(
        failures.items(),
        key=lambda kv: (
            getattr(kv[1], "stopped_by_launcher", False),
            kv[1].exitcode >= 0,
            bool(_PEER_LOST.search(message(kv[1]))),
            kv[1].timestamp,
            kv[0],
        ),
    )
    if first.exitcode < 0:
        what = f"rank {rank} was killed by {first.signal_name()}"
    else:
        text = message(first)
        what = f"rank {rank} exited with code {first.exitcode}" + (f": {text}" if text else "")
    logs = sorted(log_root.glob(f"{run_id}_*/attempt_*/{rank}/stderr.log"))
    if logs:
        where = f"its log: {logs[-1]}"
    elif first.error_file and Path(first.error_file).is_file():
        where = f"its traceback: {first.error_file}"
    else:
        where = "its output is above"
    others = f"; {len(failures) - 1} other rank(s) stopped after it" if len(failures) > 1 else ""
    return f"{what} ({where}{others})"


# ---- in the rank -------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, parent pid, start time)`` of process ``pid`` (from ``/proc``); None when it is
    gone. The start time (clock ticks since boot) tells a process from a later one with its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
    except OSError:
        return None
    return fields[0].decode(), int(fields[1]), int(fields[19])


def _die_with_launcher(launcher: int) -> None:
    """End this rank with its launcher: SIGKILL as soon as process ``launcher`` ends, however it
    ends (``kill -9``); SIGTERM (finish the step, save, return) when only the forkserver it was
    started from ends (a signal to it), so that a signal to any process of a run ends it cleanly.

    NOTE: why not ``prctl(PR_SET_PDEATHSIG)``: it fires when the *parent* dies, and a rank's
    parent is the forkserver, not the launcher. The launcher is recognised by its pid and its
    start time, read once here (immune to pid reuse; no start-up race: checked before anything
    runs, the launcher being alive while it starts ranks); a thread repeats the check every
    0.25 s. Without ``/proc`` (not Linux) ranks are not watched.
    """
    server = os.getppid()
    if not os.path.isdir("/proc/self"):
        return
    launcher_stat, server_stat = _stat(launcher), _stat(server)
    if launcher_stat is None or server_stat is None or server_stat[1] != launcher:
        os.kill(os.getpid(), signal.SIGKILL)  # the launcher ended before this rank began
        return
    born = launcher_stat[2]

    def launcher_alive() -> bool:
        stat = _stat(launcher)
        return stat is not None and stat[0] != "Z" and stat[2] == born

    def server_alive() -> bool:
        stat = _stat(server)
        return stat is not None and stat[0] != "Z"

    def watch() -> None:
        stopping = False
        while launcher_alive():
            if not stopping and not server_alive():
                stopping = True  # NOTE: once: forge.train's stop flag takes it from here
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.25)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="forge-launcher-watch", daemon=True).start()


def _redirect_output(rank_dir: Path) -> None:
    """Send this process's stdout and stderr (Python's and the C libraries') to log files."""
    for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
        try:
            target = os.open(rank_dir / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:  # NOTE: a full disk: the rank's errors still reach the launcher
            target = os.open(os.devnull, os.O_WRONLY)
        os.dup2(target, fd)
        os.close(target)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def _rank_main(
    rank: int,
    nproc: int,
    port: int,
    launcher: int,
    fn: Callable[[dict, str], Any],
    cfg_dict: dict,
    device: str,
    out: mpc.Connection,
    rank_dir: Path,
) -> None:
    """One rank: ``fn(cfg_dict, device)``; its result, or its error on one line, goes to the
    launcher through ``out``. A failure's traceback goes to the rank's stderr (rank 0, whose
    stderr is the terminal: to ``rank_dir/error.log``)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if rank > 0:
        _redirect_output(rank_dir)
    _die_with_launcher(launcher)
    try:
        value = fn(cfg_dict, device)
    except BaseException as e:  # NOTE: KeyboardInterrupt too: a Ctrl-C before the loop began
        error_file = _write_traceback(rank, rank_dir)
        with _quiet():
            out.send(("error", _one_line(f"{type(e).__name__}: {e}"), error_file))
        sys.exit(1)
    out.send(("ok", value if rank == 0 else None))


def _write_traceback(rank: int, rank_dir: Path) -> str | None:
    """The current exception's traceback to the rank's log; its file for rank 0, else None."""
    text = traceback.format_exc()
    with _quiet():
        if rank > 0:
            print(text, file=sys.stderr, flush=True)
            return None
        path = rank_dir / "error.log"
        path.write_text(text)
        return str(path)
    return None


def _quiet() -> suppress:
    """Nothing more to do when writing a log, or to a launcher or rank that is gone, fails."""
    return suppress(OSError)


# ---- in the launcher ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Rank:
    process: Any  # multiprocessing.Process
    reader: mpc.Connection
    result: tuple[Any] | None = None  # (value,) once it was sent
    failure: RankFailure | None = None
    gone: bool = False  # its pipe closed: the process has ended
    killed: bool = False  # by the launcher


class _Launch:
    """The running ranks: their results, failures and the deadlines that end a launch."""

    def __init__(self, log_dir: Path, run_id: str) -> None:
        self.log_dir, self.run_id = log_dir, run_id
        self.ranks: list[_Rank] = []
        self.signal: str | None = None
        self.deadline = float("inf")  # when the ranks still running are killed

    def on_signal(self, signum: int, frame: object) -> None:
        """SIGTERM / SIGINT: pass it to the ranks (they finish their step and save); a second
        one: kill them now."""
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            self.deadline = min(self.deadline, time.monotonic() + SHUTDOWN_GRACE_S)
            self.send(signum)
        else:
            self.deadline = 0.0

    def send(self, signum: int) -> None:
        for r in self.ranks:
            if not r.gone:
                with _quiet():
                    os.kill(r.process.pid, signum)

    def running(self) -> list[_Rank]:
        return [r for r in self.ranks if not r.gone]

    def wait(self) -> Any:
        """Read results and failures until every rank has ended; rank 0's result."""
        while live := self.running():
            timeout = max(0.0, min(0.5, self.deadline - time.monotonic()))
            for reader in mpc.wait([r.reader for r in live], timeout):
                self.read(next(r for r in live if r.reader is reader))
            if time.monotonic() >= self.deadline:
                for r in self.running():
                    r.killed = True
                    with _quiet():
                        os.kill(r.process.pid, signal.SIGKILL)
                self.deadline = float("inf")  # their pipes close now
        if all(r.result is not None for r in self.ranks):
            return self.ranks[0].result[0]  # type: ignore[index]
        if self.signal is not None:
            raise Interrupted(self.signal)
        failures = {i: r.failure for i, r in enumerate(self.ranks) if r.failure is not None}
        raise RankFailed(failure_line(failures, self.log_dir, self.run_id))

    def read(self, rank: _Rank) -> None:
        """One message from ``rank`` (its result or its error), or the end of its process."""
        index, now = self.ranks.index(rank), time.monotonic()
        try:
            kind, *payload = rank.reader.recv()
        except (EOFError, OSError):
            rank.gone = True
            rank.reader.close()
            rank.process.join(5.0)
            if rank.result is None and rank.failure is None:
                code = rank.process.exitcode
                rank.failure = RankFailure(
                    index, 1 if code is None else code, "", now, stopped_by_launcher=rank.killed
                )
                self.deadline = min(self.deadline, now + STRAGGLER_GRACE_S)
            return
        if kind == "ok":
            rank.result = (payload[0],)
            if all(r.result is not None for r in self.ranks):
                self.deadline = min(self.deadline, now + EXIT_GRACE_S)
        else:
            rank.failure = RankFailure(index, 1, payload[0], now, payload[1])
            self.deadline = min(self.deadline, now + STRAGGLER_GRACE_S)

    @contextmanager
    def forwarding_signals(self) -> Iterator[None]:
        """SIGTERM / SIGINT to the launcher go to :meth:`on_signal` (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def kill_all(self) -> None:
        """Leave no rank behind (the launcher is leaving on an error of its own)."""
        for r in self.running():
            with _quiet():
                os.kill(r.process.pid, signal.SIGKILL)
            r.process.join(5.0)


def launch_local(
    fn: Callable[[dict, str], Any],
    cfg_dict: dict,
    device: str,
    nproc: int,
    log_dir: Path,
    *,
    preload: str,
) -> Any:
    """Start ``nproc`` local ranks running ``fn(cfg_dict, device)``; returns rank 0's result.

    ``preload``: the module that runs the job, imported once in the ranks' forkserver. Raises
    :class:`RankFailed` (one line naming the rank that caused it) or, when the launcher got a
    signal and the ranks did not all finish, :class:`Interrupted`.
    """
    if device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Ranks are fresh interpreters: give them the working directory on the import path, as the
    # parent has, so a tp.plan module next to the config imports there too.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])
    )
    # NOTE: ranks fork from a forkserver that has imported torch and forge once, instead of
    # each importing them (seconds per rank, serialized on few cores); the forkserver is a
    # clean single-threaded process that has not touched CUDA. The module that runs the job
    # (forge.train, forge.job: DTensor, FSDP2, DCP) is preloaded there, next to fn's module.
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", fn.__module__, preload])
    ctx = multiprocessing.get_context("forkserver")
    run_id = f"forge-{uuid.uuid4().hex[:8]}"
    rank_dirs = [log_dir / f"{run_id}_{os.getpid()}" / "attempt_0" / str(r) for r in range(nproc)]
    for d in rank_dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RankFailed(
                f"cannot create the ranks' log directory {d}: {err.strerror}"
            ) from None
    launch, port = _Launch(log_dir, run_id), _free_port()
    with launch.forwarding_signals():
        try:
            for rank in range(nproc):
                reader, writer = ctx.Pipe(duplex=False)
                args = (
                    rank,
                    nproc,
                    port,
                    os.getpid(),
                    fn,
                    cfg_dict,
                    device,
                    writer,
                    rank_dirs[rank],
                )
                process = ctx.Process(target=_rank_main, args=args, name=f"forge-rank-{rank}")
                process.start()
                writer.close()  # NOTE: the rank holds the only write end: EOF when it ends
                launch.ranks.append(_Rank(process, reader))
            return launch.wait()
        finally:
            launch.kill_all()
