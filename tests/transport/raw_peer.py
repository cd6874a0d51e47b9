"""A hand-rolled RFC 8323 peer over a plain or TLS socket: the bytes a device in another language sends."""

from __future__ import annotations

import socket
import ssl
import time

from aiocoap import Message, optiontypes
from aiocoap.numbers.codes import Code
from aiocoap.optiontypes import BlockOption
from aiocoap.transports.tcp import _decode_message, _serialize

from edgert.transport.framing import _frame_length, serialize_head
from edgert.transport.urls import parse_url


def frame(code: Code, token: bytes = b"\x01", path: tuple[str, ...] = ("echo",), payload: bytes = b"",
          content_format: int | None = None, size1: int | None = None, query: tuple[str, ...] = (),
          block2: tuple[int, bool, int] | None = None) -> bytes:
    """One whole frame."""
    message = Message(code=code, payload=payload)
    message.token = token
    message.opt.uri_path = path
    if query:
        message.opt.uri_query = query
    if block2 is not None:
        message.opt.block2 = BlockOption.BlockwiseTuple(*block2)
    if content_format is not None:
        message.opt.content_format = content_format
    if size1 is not None:
        message.opt.size1 = size1
    return _serialize(message)


def head(code: Code, token: bytes, path: tuple[str, ...], declared: int) -> bytes:
    """The head of a frame that announces ``declared`` payload bytes (up to its payload marker)."""
    message = Message(code=code, uri_path=path)
    message.token = token
    return serialize_head(message, declared)


def csm(max_size: int = 1 << 20, blockwise: bool = False) -> bytes:
    """A CSM announcing ``max_size`` (and Block-Wise-Transfer if ``blockwise``)."""
    message = Message(code=Code.CSM)
    message.opt.add_option(optiontypes.UintOption(2, max_size))
    if blockwise:
        message.opt.add_option(optiontypes.UintOption(4, 0))
    return _serialize(message)


def anonymous_tls(cluster_pem: bytes) -> ssl.SSLContext:
    """A TLS client context that trusts the cluster but presents no certificate (a stranger)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(cadata=cluster_pem.decode())
    context.set_alpn_protocols(["coap"])
    return context


class RawPeer:
    """A connection to ``url`` that sends raw bytes and reads whole frames; sends its CSM unless told not to."""

    def __init__(self, url: str, *, tls: ssl.SSLContext | None = None, max_message_size: int = 1 << 20,
                 blockwise: bool = False, send_csm: bool = True, timeout: float = 10.0) -> None:
        _, host, port = parse_url(url)
        sock = socket.create_connection((host, port), timeout=timeout)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host if tls.check_hostname else None)
        self.sock = sock
        self.buf = b""
        self.sizes: list[int] = []  # the length of every frame read
        if send_csm:
            self.send(csm(max_message_size, blockwise))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> Message:
        """The next whole frame from the server, decoded (its length is appended to :attr:`sizes`)."""
        while True:
            info = _frame_length(self.buf)
            if info is not None:
                token_at, tkl, rest = info
                total = token_at + tkl + rest
                if len(self.buf) >= total:
                    data, self.buf = self.buf[:total], self.buf[total:]
                    self.sizes.append(total)
                    return _decode_message(data)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed by server")
            self.buf += chunk

    def read_until(self, code: Code) -> Message:
        """Read frames until one with ``code`` (skipping the server's CSM, Pings ...)."""
        while True:
            message = self.read()
            if message.code == code:
                return message

    def request(self, code: Code, path: tuple[str, ...], token: bytes, **options) -> Message:
        """Send a request and read frames until its response."""
        self.send(frame(code, token, path, **options))
        while True:
            message = self.read()
            if message.token == token and not message.code.is_signalling():
                return message

    def closed_after(self, limit: float) -> tuple[float, bytes]:
        """Seconds until the server closed this connection, and all it sent; ``inf`` if not within ``limit``."""
        start = time.monotonic()
        self.sock.settimeout(0.2)
        data = self.buf
        while time.monotonic() - start < limit:
            try:
                chunk = self.sock.recv(65536)
            except (TimeoutError, ssl.SSLWantReadError):
                continue
            except (ConnectionResetError, ssl.SSLError):
                return time.monotonic() - start, data
            if not chunk:
                return time.monotonic() - start, data
            data += chunk
        return float("inf"), data

    def close(self) -> None:
        self.sock.close()
