"""Waits that spin before they sleep.

A CPU that went idle wakes late on a VM (its vCPU halts: ~100 us here), later than a small answer
takes on loopback, and the peer that wakes it pays for the wake-up inside its own send. So a wait
for a small answer or the next small request may first poll without sleeping, for a bounded time
(``busy_wait`` on a client, ``--busy-poll`` on a server). ``Spin`` is one stream's budget: after a
spin that runs out (an answer that takes longer, an idle peer, or a peer in this process starved
of the interpreter lock by the spin) it skips spinning for twice as many waits each time, up to
63. A blocking wait spins by polling its socket (``tcp.LentTcp``); a wait on an event loop spins
by keeping the loop turning (``BusyLoop``), so every socket of that loop is polled, not one.
"""

from __future__ import annotations

import asyncio
import time
import weakref

_MAX_MISSES = 6  # after spins that keep running out, one wait in 64 spins
MAX_SPIN = 0.01  # seconds: a spin is for an answer (or a request) about to come, not a way to wait


class Spin:
    """How long each wait of one stream spins, and whether the next one should."""

    __slots__ = ("_misses", "_skip", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._misses = 0  # spins in a row that ran out
        self._skip = 0  # waits left that do not spin

    def pays(self) -> bool:
        """Whether this wait should spin: not right after spins that ran out (see the module)."""
        if self.seconds <= 0:
            return False
        if self._skip:
            self._skip -= 1
            return False
        return True

    def ended(self, caught: bool) -> None:
        """The spin caught what it waited for, or ran out."""
        if caught:
            self._misses = 0
        else:
            self._misses = min(self._misses + 1, _MAX_MISSES)
            self._skip = (1 << self._misses) - 1


class BusyLoop:
    """Keeps one event loop turning, polling its sockets without sleeping, while waits spin on it:
    a callback that schedules itself again each turn, until the last spinning wait is over or
    past its time. One per loop however many of its streams spin, so a server with many
    connections pays one callback per turn, not one per connection; a loop that stops or closes
    meanwhile just drops it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._until = 0.0  # time.perf_counter() the latest spinning wait gives up at
        self._waits = 0  # waits spinning now
        self._turning = False

    def spin(self, until: float) -> None:
        """A wait spins until ``until`` (``time.perf_counter()``), or until it calls ``done``."""
        self._waits += 1
        self._until = max(self._until, until)
        if not self._turning:
            self._turning = True
            self._loop.call_soon(self._turn)

    def done(self) -> None:
        """A spinning wait is over."""
        self._waits -= 1

    def _turn(self) -> None:
        if self._waits > 0 and time.perf_counter() < self._until:
            self._loop.call_soon(self._turn)
        else:
            self._turning = False


_LOOPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, BusyLoop] = weakref.WeakKeyDictionary()


def busy_loop(loop: asyncio.AbstractEventLoop) -> BusyLoop:
    """The one ``BusyLoop`` of ``loop``."""
    busy = _LOOPS.get(loop)
    if busy is None:
        busy = _LOOPS[loop] = BusyLoop(loop)
    return busy
