"""The served path's WebSocket connection (`_serve/transport.py`): how its system task ends."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import trio
from trio.testing import MockClock

from trio_tasksets._serve.transport import WSConnection


class _Socket:
    closed = False

    def close(self) -> None:
        self.closed = True


async def test_a_reader_failing_as_the_connection_is_ended_ends_it_with_the_reason(
    autojump_clock: MockClock,
) -> None:
    """The race a loaded machine showed: `close()` cancels the connection's scope while the
    reader fails on the closed stream, so the nursery raises Cancelled (the writer) with
    ClosedResourceError (the reader). The connection ends with the reason; nothing escapes
    its system task (before: a TrioInternalError), and the socket is closed."""
    sock = _Socket()
    conn = WSConnection(SimpleNamespace(socket=sock), None, 1 << 16, "1",  # type: ignore[arg-type]
                        max_message=1 << 20)  # fmt: skip
    writer_cancelled = trio.Event()

    async def write() -> None:
        try:
            await trio.sleep_forever()
        finally:
            writer_cancelled.set()

    async def read() -> None:
        await trio.sleep(1)
        conn._scope.cancel()  # what `_end`, called by `close()`, does
        raise trio.ClosedResourceError("another task closed this stream")

    fakes: Any = conn
    fakes._write, fakes._read = write, read
    with trio.fail_after(10):
        await conn._serve()
    assert writer_cancelled.is_set()
    assert conn.gone is not None
    assert "ClosedResourceError" in conn.gone
    assert sock.closed
