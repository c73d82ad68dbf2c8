"""The connection to Ray, with the console kept readable: which cluster a process joins or
starts, and the settings that keep Ray's and Ray Data's notices about what the job does by
design off the console. Every job, the tests and the benchmarks connect through here."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import sys
import threading
import warnings

from training import ray_private

# Ray's own notices about what this job does by design, which a user cannot act on (docs/design.md,
# "Console"), matched on what the driver prints of other processes' output:
# - Ray Data's augment actors take their constructor arguments from the object store and restart
#   when they die (ray-project/ray#57733);
# - a node that went: the raylet's death notice (with its last 20 log lines), the GCS's "marked
#   dead", a placement group's bundle it cannot free there; the job's fault line names the node
#   and faults.log keeps Ray's word on it (training/driver/faults.py);
# - the worker processes that a restart starts at once.
# Ray Data's logging for the job's runs: warnings on the console, everything in its log file
RAY_DATA_LOGGING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_data_logging.yaml")

RAY_NOTICES_SKIPPED = "|".join(
    (
        r"has constructor arguments in the object store and max_restarts > 0",
        r"Raylet is terminated\. Termination is unexpected",
        r"has been marked dead because the detector has missed too many heartbeats",
        r"gcs_placement_group_scheduler\.cc:\d+: Failed to remove",
        r"PYTHON worker processes have been started on node",
        # Ray Data's tasks on a node that went are retried by Ray: a fault the job survives
        r"Task \S+ failed\. There are \S+ retries remaining, so the task will be retried\..*search the node ID",
    )
)


def quiet_ray_env(verbose: bool = False) -> dict:
    """Keep the console readable: Ray Data logs only warnings, no deprecation noise from
    Ray's own internals, none of RAY_NOTICES_SKIPPED. Environment variables reach the
    processes of a cluster started here, and Ray reads the skip pattern when it is imported,
    so this runs before `import ray`; it imports nothing heavy. Returns ray.init's logging
    arguments. `verbose` keeps Ray's INFO logs (and its notices)."""
    if verbose:
        return {"logging_level": logging.INFO}
    skip = os.environ.get("RAY_DEDUP_LOGS_SKIP_REGEX")
    if not skip or RAY_NOTICES_SKIPPED not in skip:  # the user's own pattern stays
        os.environ["RAY_DEDUP_LOGS_SKIP_REGEX"] = f"{skip}|{RAY_NOTICES_SKIPPED}" if skip else RAY_NOTICES_SKIPPED
    os.environ.setdefault("RAY_DATA_LOGGING_CONFIG", RAY_DATA_LOGGING)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    if "ray" not in sys.modules and not (os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID")):
        # connect() will start a local cluster. Token authentication stays on, as Ray 2.60 turns it on
        # for a new one; saying so spares the console Ray's warning that it did (RAY_AUTH_MODE=disabled
        # opts out). Only before `import ray`: Ray's client reads the mode then, and a cluster started
        # in token mode would refuse a client that read another.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    return {"logging_level": logging.WARNING}


def quiet_ray_data(verbose: bool = False) -> None:
    """Ray Data draws no progress bars of its own (the trainer's per-epoch bar shows the
    progress that matters) and logs warnings only. Set before the datasets are built: they
    copy the context, and their actors see the copy. `verbose` keeps Ray Data's bars."""
    import ray.data

    if verbose:
        return
    ctx = ray.data.DataContext.get_current()
    ctx.print_on_execution_start = False
    ctx.enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)


PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def starts_local_cluster() -> bool:
    """Whether connect() will start a cluster of this machine: no RAY_ADDRESS, not under `ray job
    submit` (a process connected already, as the tests' is, is taken for one that will start it).
    Imports nothing."""
    return not (os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"))


OWN_CLUSTER_ENV = "RGA_OWN_CLUSTER"  # "1" in the processes of a cluster connect() started
_started_here: set[str] = set()  # the GCS address of the cluster this process started, if it did


def connect(verbose: bool = False, dashboard: bool = False, worker_logs: bool = True) -> bool:
    """Join the cluster of `ray job submit` / RAY_ADDRESS, or start a local one (or keep the
    one this process is already connected to). True when the cluster is one a job started on
    this machine, which lives and dies with that job's process: this process started it, or
    this is one of its workers (a sweep's trial; owns_cluster). `worker_logs`: False keeps the
    Ray workers' output in Ray's log files, off this console (a sweep's: its trials print one
    line per event)."""
    kwargs = quiet_ray_env(verbose) | ({} if worker_logs else {"log_to_driver": False})
    import ray

    _stopping.clear()  # a new job in this process (a test's, a Python caller's): Ray's lines are shown again
    own_handler = signal.getsignal(signal.SIGTERM)  # stop_on_sigterm's, where the job set it first
    try:
        if ray.is_initialized():
            started = owns_cluster()
        elif os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"):
            check_answers(os.environ.get("RAY_ADDRESS", ""))
            ray.init(**kwargs, **joined_runtime_env(verbose))
            started = False
        else:
            start_local(dashboard, kwargs)
            started = True
        quiet_ray_data(verbose)  # after ray.init: importing Ray Data first would delay the cluster's start
    except SystemExit as e:  # ray.init's SIGTERM handler: sys.exit(15), which the job left unsaid (exit 15)
        if e.code != signal.SIGTERM:
            raise
        raise TerminatedWhileStarting from None
    if callable(own_handler) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, own_handler)  # back from ray.init's, which exits without a word
    if not verbose:
        ray_private.filter_worker_output(shown_lines)
    return started


class TerminatedWhileStarting(KeyboardInterrupt):
    """SIGTERM (a scheduler cancelling the job) while connect() started or joined Ray. A
    KeyboardInterrupt, so each job's Ctrl-C path at its start says its line; `how_stopped` tells
    them apart."""


def how_stopped(error: BaseException | None = None, terminated: threading.Event | None = None) -> tuple[str, int]:
    """(the words, the exit code) of a job stopped by Ctrl-C or by SIGTERM (`terminated`: the event
    of stop_on_sigterm, set once SIGTERM came; TerminatedWhileStarting: it came inside ray.init)."""
    if isinstance(error, TerminatedWhileStarting) or (terminated is not None and terminated.is_set()):
        return "terminated (SIGTERM)", 143
    return "interrupted", 130


ANSWER_WAIT_S = 10.0  # how long a cluster's address may take to accept a connection


def check_answers(address: str, wait_s: float = ANSWER_WAIT_S) -> None:
    """ConnectionError where `address` is HOST:PORT and nothing there accepts a connection within
    wait_s: ray.init would retry such an address for minutes, printing Ray's warnings, before it
    gave up. Other forms ("auto", ray://..., a malformed one) are left to Ray, which says what is wrong."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=wait_s).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at {address} ({e.strerror or e})") from None


@contextlib.contextmanager
def driver_notices_skipped():
    """For the span, this process's own stderr (file descriptor 2) less the lines of RAY_NOTICES_SKIPPED.
    A driver that runs a Ray Data actor pool itself (jobs.predict, jobs.evaluate) gets Ray's notice about
    the pool's constructor arguments from Ray's C++ core, once an actor, past Python's logging and Ray's
    own filter of other processes' output. Enter it once Ray has started: a process started inside the
    span (a local cluster's) would hold the pipe open."""
    skip = re.compile(RAY_NOTICES_SKIPPED)
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump():
        with os.fdopen(read_end, "rb") as lines, os.fdopen(os.dup(saved), "wb", buffering=0) as out:
            for line in lines:
                if not skip.search(line.decode(errors="replace")):
                    out.write(line)

    thread = threading.Thread(target=pump, name="stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end closes: the pump reads to its end and stops
        os.close(saved)
        thread.join(timeout=5)


def start_failure(error: Exception) -> str:
    """One line for a failed connect(): Ray's first line, what was asked and where to look."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    address = os.environ.get("RAY_ADDRESS")
    if address:
        return f"joining RAY_ADDRESS={address}: {first}; check the address and that the cluster is up (ray status)"
    return f"{first}; its logs are in /tmp/ray/session_latest/logs; on a busy machine a second try often starts"


_stopping = threading.Event()  # set once the job stops on Ctrl-C or SIGTERM (mute_ray_output)


def mute_ray_output() -> None:
    """Once a job stops on Ctrl-C or SIGTERM, the lines Ray's processes send this driver are its
    teardown's (the GCS failing to kill an actor whose worker already went, a worker's SIGTERM):
    none of them is shown below or after the job's own `stopped:` line, until the next connect()
    in this process. Ray's log files keep them."""
    _stopping.set()


def shown_lines(lines: list[str]) -> list[str]:
    """What the driver prints of other processes' output (connect's filter): nothing once the job
    is stopping, else all but Ray's SIGTERM tracebacks."""
    return [] if _stopping.is_set() else without_stop_tracebacks(lines)


def without_stop_tracebacks(lines: list[str]) -> list[str]:
    """A process's output as the driver prints it, less the tracebacks of Ray's SIGTERM handler:
    Ray stops a worker it no longer needs (Ray Train's, after a node of its group went) with
    SIGTERM, and a worker that gets it while Python imports prints "Exception ignored in: ...",
    a traceback through `sigterm_handler` and "SystemExit: 1". That is Ray's way of stopping a
    process, a fault the job survives or reports in its own line; the lines stay in the worker's
    log file in Ray's session folder. Every other traceback is kept."""
    kept, at = [], 0
    while at < len(lines):
        end = _traceback_end(lines, at)
        stopped = end > at and lines[end - 1].startswith("SystemExit")
        if stopped and any("in sigterm_handler" in x for x in lines[at:end]):
            at = end
            continue
        kept.append(lines[at])
        at += 1
    return kept


def _traceback_end(lines: list[str], at: int) -> int:
    """Where the traceback that starts at lines[at] ("Exception ignored in: ..." then "Traceback
    (most recent call last):", or the latter alone) ends: just past its exception's line. `at`
    where none starts there."""
    start = at + 1 if lines[at].startswith("Exception ignored in") else at
    if start >= len(lines) or not lines[start].startswith("Traceback (most recent call last):"):
        return at
    end = start + 1
    while end < len(lines) and lines[end].startswith(" "):  # the frames: "  File ...", "    code"
        end += 1
    return min(end + 1, len(lines))  # the exception's own line


def start_local(dashboard: bool, kwargs: dict) -> None:
    """A cluster of this machine that ends with this process. Its processes (the raylet, and the
    workers it starts) inherit OWN_CLUSTER_ENV; this one and its later children do not."""
    import ray

    without_preemption_watcher()
    os.environ[OWN_CLUSTER_ENV] = "1"
    try:
        if dashboard:  # it listens on loopback only
            ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", **kwargs)
        else:
            ray.init(address="local", include_dashboard=False, **kwargs)
    finally:
        del os.environ[OWN_CLUSTER_ENV]
    _started_here.add(ray.get_runtime_context().gcs_address)


def owns_cluster() -> bool:
    """Whether the cluster this connected process is in is one connect() started: a worker of it
    (a sweep's trial), or the process that started it. Such a cluster ends with its job, and
    Ray Train runs there without its placement-group cleaner (training/ray_private.py
    trainer_class), which could take another cluster of this machine for this one."""
    import ray

    return os.environ.get(OWN_CLUSTER_ENV) == "1" or ray.get_runtime_context().gcs_address in _started_here


def without_preemption_watcher() -> None:
    """For a cluster that ends with this process: no autoscaler can drain its nodes, so Ray
    Train's preemption watcher (one more actor process to start per run) has nothing to watch.
    Ray Train reads the variable in the driver and hands it to its controller."""
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")


def joined_runtime_env(verbose: bool = False) -> dict:
    """ray.init's runtime env for a cluster the job joins: the processes there were started
    without this job's environment, so what it needs there comes through Ray's worker setup hook:
    each process learns its own cluster's address (own_cluster_address), and unless `verbose`,
    quiet_ray_env's settings (quiet_worker_process, below). A hook of the user's own, in the
    runtime env of `ray job submit`, is kept, and then neither applies."""
    if "worker_process_setup_hook" in ray_private.job_runtime_env():
        return {}
    hook = "own_cluster_address" if verbose else "quiet_worker_process"
    return {"runtime_env": {"worker_process_setup_hook": f"training.driver.session.{hook}"}}


def own_cluster_address() -> None:
    """Ray's `worker_process_setup_hook` for the processes of a cluster the job joins: RAY_ADDRESS
    names the cluster the process is in. Ray's state API finds a cluster by itself where it is
    unset, and where two clusters run on one machine it takes the one started last. Ray Train's
    placement-group cleaner asks it whether the run's controller is alive: asked on the other
    cluster, the answer was no, and it removed the placement group of a run that was training
    (tests/test_cluster.py)."""
    import ray

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


def quiet_worker_process() -> None:
    """Ray's `worker_process_setup_hook` for the processes of a cluster the job joins (`ray job
    submit`, RAY_ADDRESS; training/driver/session.py connect): what the environment does for a cluster the
    job starts itself. No deprecation notices from Ray's own code, and Ray Data's console
    gets warnings only, without its per-execution notices (ray_data_logging.yaml, found in
    this process's copy of the package: a working_dir lies elsewhere on every node). It also
    does what own_cluster_address does."""
    own_cluster_address()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.setdefault("RAY_DATA_LOGGING_CONFIG", RAY_DATA_LOGGING)
    if "ray.data" in sys.modules:  # imported already: its logging was configured without the file
        from training import ray_private

        ray_private.configure_ray_data_logging()


def stop_on_sigterm() -> threading.Event:
    """SIGTERM (what `ray job stop`, a scheduler or `kill` sends) stops the job as Ctrl-C does:
    jobs.train's Ray Train aborts the attempt and the driver says which checkpoint the same
    command resumes from; jobs.predict and jobs.evaluate remove what they had written. Set before
    connect(), which puts it back after ray.init's own (a silent exit 15, and later Ray's stack
    dump). Where SIGINT is ignored (a shell script's background job), SIGTERM raises
    KeyboardInterrupt itself: passed on as SIGINT it was lost. The event is set once SIGTERM came
    (the job then exits 143, not 130)."""
    came = threading.Event()

    def on_term(signum, frame):
        came.set()
        mute_ray_output()
        if not callable(signal.getsignal(signal.SIGINT)):  # ignored, as in a shell script's background job
            raise KeyboardInterrupt
        signal.raise_signal(signal.SIGINT)  # to whichever SIGINT handler is current: Ray Train's while it fits

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    return came


def stopped(out: str, error: BaseException | None = None, terminated: threading.Event | None = None) -> int:
    """Say that a job stopped by Ctrl-C or SIGTERM (how_stopped's arguments) before `out` was written,
    having removed what it wrote of it (jobs.predict, jobs.evaluate, jobs.prepare, jobs.export); its
    exit code."""
    mute_ray_output()
    how, code = how_stopped(error, terminated)
    line = f"stopped: {how}; {out} was not written (its parts so far are removed); run the same command again"
    print(line, file=sys.stderr)
    return code


@contextlib.contextmanager
def sigint_kept():
    """Around Ray Train's fit: it sets a SIGINT handler of its own (Ctrl-C aborts the controller)
    and leaves it set when fit returns. In a process that goes on (a notebook, a pipeline's step,
    a test) the stale handler then took Ctrl-C, and the SIGTERM that stop_on_sigterm hands to
    SIGINT, for the finished run's controller: the stop was lost. The handler before fit comes back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before if before is not None else signal.SIG_DFL)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """stop_on_sigterm for a span (a sweep's Tune run, in the caller's process when called from
    Python): the event it sets; the handler before it comes back at the end (the default where it
    was not Python's: Ray's C++ one, which dumps the stack)."""
    if threading.current_thread() is not threading.main_thread():
        yield threading.Event()
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield stop_on_sigterm()
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
        _stopping.clear()  # a Python caller's later output shows Ray's lines again
