"""Who gets in: QoS classes and the memory watermarks, one rule for the in-process
`AdaptiveServer` and the HTTP server.

- >= `shrink` (60%): caches shrink (the caller's lever: result cache, prefix cache);
- >= `protect` (80%): the lowest QoS class is not admitted;
- >= `shed` (95%): every new request is shed. Admitted requests are always finished.
"""
from __future__ import annotations

from dataclasses import dataclass

from rbcompile.errors import UserError

QOS_CLASSES = ("interactive", "standard", "batch")  # highest priority first


@dataclass(frozen=True)
class Watermarks:
    shrink: float = 0.60
    protect: float = 0.80
    shed: float = 0.95
    pressure_budget: float = 0.3   # the least budget above the protect watermark

    def level(self, memory: float) -> int:
        """0 below every mark, 1 from `shrink`, 2 from `protect`, 3 from `shed`."""
        return sum(memory >= mark for mark in (self.shrink, self.protect, self.shed))


class Overloaded(UserError):
    """A request refused for load, not for what it asks: `reason` is 'shed' (memory or queue)
    or 'rejected' (its QoS class is not admitted now). Retrying later can succeed."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def check_qos(qos: str) -> int:
    """The class's priority (0 first); a one-line UserError for an unknown class."""
    if qos not in QOS_CLASSES:
        raise UserError(f"unknown QoS class {qos!r} (known: {', '.join(QOS_CLASSES)})")
    return QOS_CLASSES.index(qos)


def admit(qos: str, memory: float, queued: int, marks: Watermarks, max_queue: int,
          requests: int = 1) -> None:
    """Raise `Overloaded` when `requests` of class `qos` may not join a queue of `queued`
    requests with system memory at `memory` (a [0, 1] fraction)."""
    if memory >= marks.shed:
        raise Overloaded("shed", f"overloaded: memory at {memory:.0%} (>= {marks.shed:.0%} "
                                 "watermark); request shed, retry later")
    if memory >= marks.protect and qos == QOS_CLASSES[-1]:
        raise Overloaded("rejected", f"memory at {memory:.0%} (>= {marks.protect:.0%} watermark): "
                                     f"not admitting QoS class {qos!r} now")
    if queued + requests > max_queue:
        raise Overloaded("shed", f"queue full ({queued} of {max_queue} requests waiting, "
                                 f"{requests} more asked); retry later")
