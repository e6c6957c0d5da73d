"""The host workers of the engine: the one error record (:class:`StickyError`), the queue of worker jobs in
forward order (:class:`_WorkQueue`), the threads that run them and cut batches into jobs (:class:`WorkerPool`),
their lock-free counters (:class:`Counters`) and what ``os.fork()`` leaves of them. No torch or jax import;
nothing of the slots (the host placement, ``_host.py``, orders each slot's batches).

Fork: a child of ``os.fork()`` has no worker threads and maybe a lock a worker held; every pool of the parent is
marked :attr:`WorkerPool.forked` there (its owner refuses work with :data:`FORKED` and closes without waiting) and
its finalizer detached (nothing to stop).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import os
import threading
import traceback
import weakref
from typing import Any, Callable, Sequence

from .._cores import bind_current_thread

__all__ = ["Counters", "FORKED", "StickyError", "WORKER_NICE", "WorkerError", "WorkerPool"]

#: The workers' default nice value (see :class:`~trainstream.core._host.HostPlacement`'s ``worker_nice``).
WORKER_NICE = 5

FORKED = ("TrainStream: this optimizer was built in the parent process before os.fork(); its "
          "worker threads do not exist in this child process. Build a new optimizer in the "
          "child (or fork before building it).")


class WorkerError(RuntimeError):
    """A failure inside an engine worker thread, raised at the next call into the engine."""


class StickyError:
    """The engine's one error record: the first failure of a worker (or of a step that left one placement
    updated and the other not), raised at every later call until the state has been reloaded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._text: str | None = None

    def record(self, exc: BaseException) -> None:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        with self._lock:
            if self._text is None:
                self._text = text

    def check(self) -> None:
        """Raise :class:`WorkerError` if a failure is recorded."""
        msg = self._text  # an atomic read: only record() needs the lock
        if msg is not None:
            raise WorkerError(f"TrainStream optimizer worker failed: {msg}. The optimizer state of the parameters "
                              "updated in that step may be partly updated; reload a checkpoint (load_state_dict) to "
                              "continue from a consistent state.")

    @property
    def failed(self) -> bool:
        """Whether a failure is recorded."""
        return self._text is not None

    def clear(self) -> None:
        self._text = None


class Counters:
    """Counters without a lock (a contended lock makes a worker give up the GIL): each thread adds
    into its own dict, readers sum them (``counters.name``)."""

    def __init__(self, names: Sequence[str]) -> None:
        self._names = tuple(names)
        self._local = threading.local()
        self._all: list[dict] = []
        self.step_start = self.last_finalize = 0.0

    def add(self, name: str, value: float) -> None:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = dict.fromkeys(self._names, 0)
            self._all.append(d)  # list.append is atomic
        d[name] += value

    def __getattr__(self, name: str):
        if name != "_names" and name in self._names:
            return sum(d[name] for d in list(self._all))
        raise AttributeError(name)


class _WorkQueue:
    """Worker jobs in *forward order*: slot id (the order the next forward needs the parameters, while eager
    updates arrive in backward order), then submission order. Within a slot only the oldest job is eligible.
    A job whose gradient copy has not landed (``ready()`` False) is passed over for the lowest slot among the
    first :attr:`_SCAN` whose oldest job can run; if none can, the oldest job of all is taken (copies land in
    submission order). A get costs at most O(_SCAN) ``ready`` calls (cached per batch by :func:`landed_query`;
    they must not raise); a stop (:meth:`close`) is handed out only once no job is left.
    """

    _SCAN = 16  # slots examined per pick

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._slots: dict[float, collections.deque] = {}  # priority -> its jobs, oldest first
        self._order: list[float] = []  # priorities with jobs, ascending
        self._all: collections.deque = collections.deque()  # every job entry, oldest first
        self._jobs = self._stops = 0
        self._closed = False
        self._seq = itertools.count()

    def close(self, workers: int) -> None:
        """Refuse new jobs; each of ``workers`` stops once no job is left."""
        with self._cond:
            self._closed = True
            self._stops += workers
            self._cond.notify_all()

    def put_many(self, jobs: Sequence[Callable[[], None]], priority: float = 0.0,
                 ready: Callable[[], bool] | None = None) -> None:
        """Queue one batch's ``jobs`` (one slot, one ``ready`` predicate). Raises once closed (a waiter,
        e.g. an XLA callback at interpreter exit, would hang)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("TrainStream: the host workers have stopped (the engine was closed, or the "
                                   "interpreter is exiting); no update runs any more")
            q = self._slots.get(priority)
            if q is None:
                q = self._slots[priority] = collections.deque()
                bisect.insort(self._order, priority)
            for job in jobs:
                entry = [priority, next(self._seq), job, ready, False]  # last: taken
                q.append(entry)
                self._all.append(entry)
            self._jobs += len(jobs)
            self._cond.notify(len(jobs))

    def _take(self, entry: list) -> Callable[[], None]:
        entry[4] = True
        q = self._slots[entry[0]]
        q.popleft()  # always its slot's oldest: picked as a head, or as the oldest job of all
        if not q:
            del self._slots[entry[0]]
            self._order.pop(bisect.bisect_left(self._order, entry[0]))
        self._jobs -= 1
        while self._all and self._all[0][4]:  # drop the entries already taken
            self._all.popleft()
        return entry[2]

    def get(self) -> Callable[[], None] | None:
        with self._cond:
            while not self._jobs and not self._stops:
                self._cond.wait()
            if not self._jobs:
                self._stops -= 1
                return None
            for priority in self._order[: self._SCAN]:
                head = self._slots[priority][0]
                if head[3] is None or head[3]():
                    return self._take(head)
            return self._take(self._all[0])  # the oldest job left (taken ones are dropped)


def landed_query(query: Callable[[], bool]) -> Callable[[], bool]:
    """A batch's ``ready()`` for its chunks: True once its event completed, or a query failed (the body raises)."""
    done = False

    def ready() -> bool:
        nonlocal done
        if not done:
            try:
                done = bool(query())
            except Exception:  # noqa: BLE001
                return True
        return done
    return ready


#: The pools of this process (see the module docstring on fork).
_LIVE: weakref.WeakSet = weakref.WeakSet()


class WorkerPool(_WorkQueue):
    """The one :class:`_WorkQueue` shared by ``threads`` workers, bound to ``cores`` (None: unbound) at nice
    value ``nice``, for the lifetime of ``owner``: its finalizer (:meth:`stop`) stops the threads once ``owner``
    is collected, or at interpreter exit. Holds nothing of ``owner``."""

    def __init__(self, owner: Any, threads: int, nice: int = WORKER_NICE, cores: Sequence[int] | None = None):
        super().__init__()
        self._nice = int(nice)
        self._cores = list(cores) if cores else None
        self.forked = False
        self._threads = [threading.Thread(target=self._run, name=f"trainstream-worker-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()
        self._finalizer = weakref.finalize(owner, self._shutdown)  # holds the pool, not the owner
        _LIVE.add(self)

    def _run(self) -> None:
        try:  # Linux applies nice values per thread; elsewhere a no-op
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        except (AttributeError, OSError):
            pass
        bind_current_thread(self._cores)
        while True:
            job = self.get()
            if job is None:
                return
            job()

    def submit(self, numel: int, chunk: int, priority: float, landed: Any, body: Callable[[int, int, int], None],
               finalize: Callable[[], None] | None, record: Callable[[BaseException], None],
               done: Callable[[], None]) -> None:
        """Queue one batch: ``body(chunk, begin, end)`` over the chunks of ``chunk`` elements of ``numel``. The last
        chunk to finish calls ``finalize()`` if no chunk raised, then ``done()``; every exception goes to
        ``record``. ``landed``: the copy the body waits for (its ``query()`` feeds :class:`_WorkQueue`)."""
        nchunks = max(1, -(-numel // chunk))
        finished = itertools.count(1)  # next() is atomic: no lock between the workers
        failed: list[BaseException] = []
        query = getattr(landed, "query", None)

        def job(c: int, b: int, e: int) -> None:
            try:
                body(c, b, e)
            except BaseException as exc:  # noqa: BLE001 - recorded, raised later
                failed.append(exc)
                record(exc)
            if next(finished) == nchunks:  # the batch's last chunk to finish
                try:
                    if finalize is not None and not failed:
                        finalize()
                except BaseException as exc:  # noqa: BLE001
                    record(exc)
                finally:
                    done()

        jobs = [(lambda c=c, b=c * chunk, e=min(numel, (c + 1) * chunk): job(c, b, e)) for c in range(nchunks)]
        self.put_many(jobs, priority, landed_query(query) if query is not None else None)

    def in_worker(self) -> bool:
        """Whether the calling thread is one of this pool's workers."""
        return threading.current_thread() in self._threads

    def stop(self) -> None:
        """Stop the workers once every queued job has run, joining them (once; a no-op in a child of os.fork())."""
        self._finalizer()

    def _shutdown(self) -> None:
        self.close(len(self._threads))  # each worker stops after every queued job
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()


def _orphan_after_fork() -> None:
    for pool in list(_LIVE):
        pool.forked = True
        pool._finalizer.detach()  # its workers did not survive the fork: nothing to stop


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_orphan_after_fork)
