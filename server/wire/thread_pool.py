"""The thread pool the gRPC servers run their handlers on: it grows with a burst of calls and
gives the threads back after it.

``concurrent.futures.ThreadPoolExecutor`` keeps every thread it ever started until it is shut
down, so a shard that once served a crowd of calls kept hundreds of idle threads for the rest
of its life. :class:`ShrinkingThreadPool` is that executor with one change: a thread that has
waited ``idle_s`` without work ends, while more than ``keep`` threads are left.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

DEFAULT_KEEP = 8  # threads a pool keeps however long it idles
DEFAULT_IDLE_S = 20.0  # how long a thread past those waits for work before it ends


class ShrinkingThreadPool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` of at most ``max_workers`` threads whose threads past ``keep``
    end after ``idle_s`` seconds without work (so ``len(pool.threads())`` falls back after a burst).

    Its threads are daemons: a server's process may end with a handler still running.
    """

    def __init__(self, max_workers: int, keep: int = DEFAULT_KEEP, idle_s: float = DEFAULT_IDLE_S,
                 thread_name_prefix: str = ""):
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        if keep < 0 or idle_s <= 0:
            raise ValueError(f"keep must be >= 0 and idle_s > 0, got {keep} and {idle_s}")
        self._keep = keep
        self._idle_s = idle_s
        self._numbers = itertools.count()

    def threads(self) -> frozenset:
        """The pool's threads now."""
        with self._shutdown_lock:
            return frozenset(self._threads)

    def _adjust_thread_count(self) -> None:
        # called by submit with _shutdown_lock held, right after it queued the work item
        if self._idle_semaphore.acquire(timeout=0):  # an idle thread takes it
            return
        if len(self._threads) < self._max_workers:
            thread = threading.Thread(name=f"{self._thread_name_prefix or 'pool'}_{next(self._numbers)}",
                                      target=self._work, daemon=True)
            self._threads.add(thread)
            thread.start()

    def _work(self) -> None:
        """A thread's loop: runs work items; ends at shutdown, or after ``idle_s`` without work
        while the pool holds more than ``keep`` threads."""
        me = threading.current_thread()
        while True:
            try:
                item = self._work_queue.get(timeout=self._idle_s)
            except queue.Empty:
                if self._leave(me):
                    return
                continue
            if item is None:  # shutdown: tell the next thread too
                self._work_queue.put(None)
                return
            item.run()
            del item
            self._idle_semaphore.release()  # idle again: the next submit may count on this thread

    def _leave(self, me: threading.Thread) -> bool:
        """Whether an idle thread ends now. Under the lock submit holds while it queues an item
        and claims an idle thread for it: a thread claimed meanwhile finds no idle count to take
        and stays for the item."""
        with self._shutdown_lock:
            if self._shutdown or len(self._threads) <= self._keep:
                return False
            if not self._idle_semaphore.acquire(timeout=0):
                return False
            self._threads.discard(me)
            return True
