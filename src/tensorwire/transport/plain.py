"""A stream's plain calls, for code that runs its I/O itself rather than awaiting it: a thread
that borrows an idle connection (``LentStream``: the blocking client's small calls, lending.py),
and a loop's readiness callback that serves what came in (``ReadyIO``: the server's small
requests, ``ByteStream.serve_idle``)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Protocol

from tensorwire.transport.base import Buffer, ByteStream


class ReadyIO(Protocol):
    """A socket's plain calls from its loop's readiness callback; neither ever waits."""

    def try_recv(self, buf: memoryview) -> int | None:
        """Bytes received into ``buf`` (0: the peer closed); None: none are there."""
        ...

    def try_send(self, data: Buffer) -> int:
        """How many bytes of ``data`` the kernel took (0: none fit now)."""
        ...


class LentStream(ByteStream):
    """The twin of a lent stream, driven by one borrowing thread: its waits block that thread until
    ``deadline`` (TransferTimeout then), each spinning first for up to ``spin`` seconds (the
    borrower's ClientOptions.busy_wait), so its coroutines never suspend. ``recv_now`` and
    ``send_now`` (of one buffer) are its reads and writes as plain calls, for a borrower's small
    requests. A borrowed call runs from ``begin`` (False: not quiet: the peer closed it, or sent
    bytes unasked, since the last answer; it goes back to the loop) to ``end``; an owner's close in
    between leaves the descriptor for ``end`` to close."""

    deadline: float = 0.0  # time.monotonic()
    spin: float = 0.0

    @abstractmethod
    def begin(self) -> bool: ...

    @abstractmethod
    def end(self) -> None: ...

    @abstractmethod
    def recv_now(self, buf: memoryview) -> int: ...

    @abstractmethod
    def send_now(self, frame: bytes) -> None: ...
