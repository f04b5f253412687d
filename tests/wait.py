"""Waiting in tests for something to happen, not for a time to pass.

A test that sleeps and then counts what happened meanwhile fails at random on a shared CI machine
(issue 12). These helpers poll a condition until it holds; the timeout only keeps a broken test
from hanging, it is not a speed the code must reach.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

TIMEOUT_S = 30.0  # generous: reached only when the awaited thing never happens


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = TIMEOUT_S,
               poll_s: float = 0.005) -> None:
    """Poll `condition` every `poll_s` until it is true; AssertionError naming `what` past
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)


async def async_wait_until(condition: Callable[[], object], what: str,
                           timeout_s: float = TIMEOUT_S, poll_s: float = 0.005) -> None:
    """`wait_until` inside an event loop (the loop runs while it waits)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        await asyncio.sleep(poll_s)
