"""Lines to and from a running program, each wait bounded by one deadline for the whole talk.

The ``code`` reward's test driver speaks to the scored program through this. The program
is hostile: it may stop reading, never answer, answer forever without a newline, or close
its end. Each of those ends the conversation (:class:`ConversationOver`) within the
deadline and the size bound; none can block the driver or fill its memory.
"""

from __future__ import annotations

import os
import select
import time
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from forgerl_plugins.rewards.sandbox_outcome import RunOutcome

#: The largest message the program may send (a test's result: a long list is fine).
MAX_MESSAGE_BYTES = 16 << 20


class ConversationOver(Exception):
    """The program closed its end, did not answer in time, or sent more than a message may hold."""


class Conversation:
    def __init__(self, to_program: IO[bytes], from_program: IO[bytes], *, seconds: float):
        self._out, self._in = to_program.fileno(), from_program.fileno()
        os.set_blocking(self._out, False)  # a program that stops reading cannot block a write
        self._deadline = time.monotonic() + seconds
        self._buffer = bytearray()
        #: How the program ended, set by :meth:`Sandbox.converse` when the block is left.
        self.outcome: RunOutcome | None = None

    def send(self, line: bytes) -> None:
        view = memoryview(line)
        while view:
            self._wait(write=True)
            try:
                written = os.write(self._out, view)
            except BlockingIOError:
                continue
            except OSError as exc:  # the program closed its stdin (BrokenPipeError) or died
                raise ConversationOver(f"the program stopped reading ({exc.strerror})") from None
            view = view[written:]

    def receive(self) -> bytes:
        """The next line, without its newline."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return line
            if len(self._buffer) > MAX_MESSAGE_BYTES:
                raise ConversationOver(f"the program sent a message over {MAX_MESSAGE_BYTES} bytes")
            self._wait(write=False)
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise ConversationOver("the program ended")
            self._buffer += chunk

    def _wait(self, *, write: bool) -> None:
        left = self._deadline - time.monotonic()
        fd = self._out if write else self._in
        ready = (
            select.select([], [fd], [], max(0.0, left))
            if write
            else select.select([fd], [], [], max(0.0, left))
        )
        if not (ready[1] if write else ready[0]):
            raise ConversationOver("the program did not answer in time")

    def close(self) -> None:
        self._buffer.clear()
