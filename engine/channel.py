"""Blocking framed I/O over one socket: how the core process (and a disaggregated worker) reads and
writes the RPC channel's messages (engine/protocol.py), and how the front end stops a core."""

from __future__ import annotations

import contextlib
import select
import socket

from engine.protocol import Codec, FrameBuffer, Message, frame

RECV_BYTES = 1 << 16


class Channel:
    """Blocking framed I/O over one socket; the core's side of the RPC channel."""

    def __init__(self, sock: socket.socket, codec: Codec) -> None:
        self.sock, self.codec, self.frames = sock, codec, FrameBuffer()
        self.eof = False
        self.sock.setblocking(True)

    def send(self, msg: Message) -> None:
        self.sock.sendall(frame(self.codec.encode(msg)))

    def receive(self, block: bool, timeout: float | None = None) -> list[Message] | None:
        """Every complete message pending now; with `block`, first wait until the socket is readable
        (`timeout` None: forever). None at EOF: the other side is gone."""
        if self.eof:
            return None
        if block and not select.select([self.sock], [], [], timeout)[0]:
            return []
        msgs: list[Message] = []
        while True:
            try:
                data = self.sock.recv(RECV_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return msgs
            if not data:
                self.eof = True  # messages that came before EOF still count (a core's last words)
                return msgs or None
            msgs += [self.codec.decode(b) for b in self.frames.feed(data)]


def send_quietly(channel: Channel, msg: Message) -> None:
    """Send `msg` if the other side still listens; a closed socket is not an error here."""
    with contextlib.suppress(OSError):
        channel.send(msg)
