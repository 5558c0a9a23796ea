"""The requests waiting for rows of the batch engine, in the order they join: the most urgent
priority (QoS class) first; within it the group of the client that holds the fewest running
rows, then the earliest. With one client that is arrival order; with several, a client that
queued many requests takes turns with the others instead of holding every row until its
queue drains. When the next group does not fit and its client holds less than its fair share
of rows (max_batch / clients with requests), rows of clients over their share, none more urgent
than it, go back to the queue (`fair_victims`): no client holds more than its share of rows
while another waits for one."""
from __future__ import annotations

import bisect
import itertools
from collections import Counter
from dataclasses import dataclass, field


@dataclass(order=True)
class WaitingGroup:
    """Requests on one prompt that join together (`requests`: EngineRequests of one client)."""
    priority: int
    arrival: int
    requests: tuple = field(compare=False)

    @property
    def client(self):
        return self.requests[0].client


class WaitingQueue:
    """Groups sorted by (priority, arrival); `next(running)` picks as the module says. Not
    locked: the engine holds its lock around every call."""

    def __init__(self):
        self.groups: list[WaitingGroup] = []
        self.arrivals = itertools.count()

    def push(self, priority: int, requests: tuple) -> None:
        bisect.insort(self.groups, WaitingGroup(priority, next(self.arrivals), requests))

    def next(self, running: Counter) -> WaitingGroup | None:
        """The group to join next, `running` counting the rows each client holds."""
        best = None
        for group in self.groups:
            if group.priority != self.groups[0].priority:
                break
            held = running[group.client]
            if held == 0:
                return group    # the earliest group of a client holding no row
            if best is None or held < running[best.client]:
                best = group
        return best

    def remove(self, group: WaitingGroup) -> None:
        self.groups.remove(group)

    def __bool__(self) -> bool:
        return bool(self.groups)

    def __iter__(self):
        return iter(self.groups)

    @property
    def requests(self) -> int:
        return sum(len(group.requests) for group in self.groups)

    def by_priority(self) -> dict[int, int]:
        """Requests waiting per priority."""
        counts: dict[int, int] = {}
        for group in self.groups:
            counts[group.priority] = counts.get(group.priority, 0) + len(group.requests)
        return counts

    def clients(self, running: list) -> int:
        """Clients with requests running or waiting."""
        return len({request.client for request in running} | {group.client for group in self.groups})


def fair_victims(running: list, group: WaitingGroup, held: Counter, max_batch: int, free: int,
                 clients: int) -> list[int]:
    """Indices of running rows to send back so `group` fits in `free` rows plus theirs: rows of
    clients over their share, least work to redo first, none more urgent than `group`; none
    when its client would go over its own share or too few rows qualify."""
    share, need = -(-max_batch // max(clients, 1)), len(group.requests) - free
    if clients < 2 or held[group.client] + len(group.requests) > share:
        return []
    counts, chosen = held.copy(), []
    by_work = sorted(range(len(running)), key=lambda i: len(running[i].context))
    for index in by_work:
        request = running[index]
        if request.client != group.client and counts[request.client] > share \
                and request.priority >= group.priority:
            chosen.append(index)
            counts[request.client] -= 1
            if len(chosen) == need:
                return chosen
    return []
