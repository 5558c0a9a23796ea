"""Progress messages for long steps (printed to stderr so stdout stays machine-readable)."""
import sys
import time
from contextlib import contextmanager


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextmanager
def step(message: str):
    """Print `message ...`, run the block, then print how long it took."""
    say(f"{message} ...")
    start = time.perf_counter()
    yield
    say(f"  done in {time.perf_counter() - start:.1f}s")
