"""Waiting queues: FCFS (a deque) and priority (a heap), behind one small ABC."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from scheduler.config import SchedulingPolicy
from scheduler.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    """Lower is better: (priority, arrival_time), as in vLLM."""
    return (request.priority, request.arrival_time)


class RequestQueue(ABC):
    """The waiting queue of one scheduler. ``peek``/``pop`` return the next request to admit."""

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put a request back at the front (FCFS) or into its place (priority)."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in admission order."""

    def prepend_requests(self, requests: list[Request]) -> None:
        """Put requests back so that they come out in the order given."""
        for request in reversed(requests):
            self.prepend_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """First come, first served."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in to_remove)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lowest ``(priority, arrival_time, request_id)`` first, as in vLLM."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, request.request_id, request)
        )

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][3]

    def prepend_request(self, request: Request) -> None:
        # A heap has no front: the request goes back to the place its key gives it.
        self.add_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[3]) not in to_remove]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
