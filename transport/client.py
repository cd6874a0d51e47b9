"""The client side: requests with explicit timeouts and retries, observe, discovery, sends from other threads.

:class:`TensorClient` runs on an asyncio loop and keeps one aiocoap context with
a CoAP-over-TCP pool (one connection per peer, reused) and a UDP endpoint::

    async with TensorClient() as client:
        await client.send("coap+tcp://10.0.0.2:5701", "stage/1/activations", env, codec="int8:axis=1")
        weights = await client.fetch(url, "stage/1/weights")
        async for note in client.observe(url, "health"):
            ...

Error responses raise the matching :mod:`~edgert.transport.errors` class
(``NotFound``, ``BadRequest``...). Timeouts and network errors are retried
``retries`` times with exponential backoff, then raise :class:`RequestTimeout`
or :class:`PeerUnreachable`; 5.03 is retried too. A retried POST may arrive twice:
receivers deduplicate on (run_id, step, microbatch, stage). A ``coap+tcp://`` request to a
TLS server raises :class:`PeerUnreachable` saying the peer speaks TLS (``coaps+tcp://``).

With credentials, ``coap://`` requests are OSCORE-protected (:mod:`~edgert.transport.oscore`);
the coordinator names the device in the URL: ``coap://NAME@host:port``.

Payloads beyond the peer's Max-Message-Size go as BERT blocks (aiocoap); between edgert endpoints one of up
to :attr:`Limits.max_payload_bytes` is one message (docs/PROTOCOL.md, "Large messages"); with ``pieces=``
(:class:`~edgert.transport.transfers.PieceOptions`) an envelope over a piece, and its answer, go in pieces
(§12). Over TCP an envelope's tensor data goes to the socket straight from the arrays (no encode copy), so
leave them unchanged until the request returns; a retry re-reads them.

:meth:`TensorClient.submit` sends from another thread without waiting (the tensor path,
:mod:`~edgert.transport.submission`); :class:`~edgert.transport.sync_client.SyncClient` gives
threads a blocking API over a client that lives on a loop in another thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiocoap
import aiocoap.util
from aiocoap import Message
from aiocoap import error as coap_error
from aiocoap.message import UndecidedRemote
from aiocoap.messagemanager import MessageManager
from aiocoap.numbers.codes import Code
from aiocoap.numbers.constants import TransportTuning
from aiocoap.protocol import BlockwiseRequest
from aiocoap.tokenmanager import TokenManager
from aiocoap.transports.udp6 import MessageInterfaceUDP6

from edgert.transport import coap_tcp, coap_tcp_pool, deadline, linkformat
from edgert.transport.coap_tcp import TLS_SCHEME
from edgert.transport.envelope import CONTENT_FORMAT, CodecChoice, Envelope, encode_envelope_parts
from edgert.transport.errors import RETRIED_CODES, MalformedMessage, PeerUnreachable, RequestTimeout
from edgert.transport.framing import frame_head
from edgert.transport.limits import DEFAULT_LIMITS, HEAD_SLACK, Limits
from edgert.transport.message import Response, method_code
from edgert.transport.observe import Observation
from edgert.transport.oscore import OscoreRequests
from edgert.transport.oscore_keys import OscoreKeys
from edgert.transport.submission import Attempts, Submission, WrittenRequests
from edgert.transport.tls import TlsCredentials, speaks_tls
from edgert.transport.transfers import PieceOptions, request_in_pieces
from edgert.transport.urls import format_url, parse_url

Payload = Envelope | bytes | bytearray | memoryview | None
"""A request body: an envelope (encoded here) or raw bytes; tensors and memoryviews are referenced, not copied."""
Body = tuple[coap_tcp.Buffer, ...]


@dataclass(frozen=True)
class ClientConfig:
    """Timeouts and retries of a :class:`TensorClient`; every request may override timeout and retries."""

    timeout: float = 10.0
    """Seconds one attempt may take (connect + send + response)."""
    retries: int = 2
    """Further attempts after a timeout, a network error or 5.03."""
    backoff: float = 0.05
    """Seconds before the first retry; doubled for each further one."""
    connect_timeout: float = 5.0
    """Seconds a new TCP connection may take to deliver the peer's CSM."""
    udp_ack_timeout: float = 2.0
    """CoAP-over-UDP ACK_TIMEOUT (RFC 7252): first retransmission of a confirmable message."""
    udp_max_retransmit: int = 4
    """CoAP-over-UDP MAX_RETRANSMIT."""

    def __post_init__(self) -> None:
        for name in ("timeout", "connect_timeout", "udp_ack_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"ClientConfig.{name} must be a positive number, got {value!r}")
        if not isinstance(self.backoff, (int, float)) or self.backoff < 0:
            raise ValueError(f"ClientConfig.backoff must be >= 0, got {self.backoff!r}")
        for name in ("retries", "udp_max_retransmit"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ClientConfig.{name} must be an int >= 0, got {value!r}")


class _UdpTuning(TransportTuning):
    def __init__(self, ack_timeout: float, max_retransmit: int) -> None:
        self.ACK_TIMEOUT = ack_timeout
        self.MAX_RETRANSMIT = max_retransmit


class TensorClient:
    """Async CoAP client for edgert peers; one instance per process (or per loop) is enough."""

    def __init__(self, config: ClientConfig = ClientConfig(), limits: Limits = DEFAULT_LIMITS,
                 tls: TlsCredentials | None = None) -> None:
        if not isinstance(config, ClientConfig):
            raise TypeError(f"config must be a ClientConfig, got {type(config).__name__}")
        self.config = config
        self.limits = limits
        self.tls = tls
        self._context: aiocoap.Context | None = None
        self._tcp: coap_tcp_pool.LargeTCPClient | None = None
        self._tls_tcp: coap_tcp_pool.LargeTCPClient | None = None
        self._targets: dict[str, tuple[str, str, tuple[str, ...]]] = {}
        self._udp_remotes: dict[str, Any] = {}
        self._udp_names: dict[str, str] = {}  # hostinfo -> device name from coap://NAME@host:port (OSCORE)
        self._oscore: OscoreRequests | None = None
        self._udp_tuning = _UdpTuning(config.udp_ack_timeout, config.udp_max_retransmit)
        self._starting: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resources: dict[tuple, tuple[dict, tuple[str, int | None], bytes]] = {}  # see _lean_head
        self.submissions: set[Submission] = set()
        """Submitted requests in flight (loop thread only); see :meth:`cancel_submissions`."""
        self._written: WrittenRequests | None = None  # submitted requests written from other threads
        self._in_pieces: set[concurrent.futures.Future] = set()  # submitted bodies in pieces (tasks on the loop)

    async def start(self) -> TensorClient:
        """Create the aiocoap context (also done lazily by the first request)."""
        if self._context is not None:
            return self
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._create_context())
        await asyncio.shield(self._starting)
        return self

    async def _create_context(self) -> None:
        loop = asyncio.get_running_loop()
        context = aiocoap.Context(loop=loop, loggername="coap")
        tcp = await coap_tcp_pool.add_tcp_client(context, max_message_size=self.limits.tcp_max_message_size)
        tcp.csm_timeout = self.config.connect_timeout
        self._tcp = tcp
        if self.tls is not None:
            tls = await coap_tcp_pool.add_tcp_client(context, max_message_size=self.limits.tcp_max_message_size,
                                                ssl_context=self.tls.client_context)
            tls.csm_timeout = self.config.connect_timeout
            tls.check_peer = self.tls.check
            self._tls_tcp = tls
        tokens = TokenManager(context)
        messages = MessageManager(tokens)
        udp = await MessageInterfaceUDP6.create_client_transport_endpoint(messages, log=context.log, loop=loop)
        messages.message_interface = udp
        tokens.token_interface = messages
        if self.tls is not None and self.tls.oscore is not None:  # coap:// requests go OSCORE-protected
            self._oscore = OscoreRequests(context, OscoreKeys(self.tls), self._udp_names)
            context.request_interfaces.append(self._oscore)
        context.request_interfaces.append(tokens)
        self._context = context
        self._written = WrittenRequests(loop)
        self._loop = loop

    async def cancel_submissions(self) -> None:
        """End every request still in flight (a submitted one's future cancelled, an awaited one's with
        PeerUnreachable) and wait until none runs: call before the connections close, so none fails after
        the loop is gone."""
        if self._written is not None:
            self._written.stop()
        submissions, self.submissions = self.submissions, set()
        tasks = [task for task in (submission.cancel() for submission in submissions) if task is not None]
        in_pieces, self._in_pieces = self._in_pieces, set()
        for future in in_pieces:
            future.cancel()
        await asyncio.gather(*tasks, *(asyncio.wrap_future(f) for f in in_pieces), return_exceptions=True)

    async def close(self) -> None:
        """Release every connection; idempotent."""
        await self.cancel_submissions()
        context, self._context = self._context, None
        self._loop = None
        self._written = None
        self._resources.clear()
        self._starting = None
        self._udp_remotes.clear()
        if context is not None:
            await context.shutdown()
        oscore, self._oscore = self._oscore, None
        if oscore is not None:
            oscore.keys.close()

    async def __aenter__(self) -> TensorClient:
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    # -- requests -------------------------------------------------------------

    async def request(self, method: str, url: str, path: str = "", payload: Payload = None, *,
                      codec: CodecChoice = None, content_format: int | None = None,
                      query: Mapping[str, str] | None = None, timeout: float | None = None,
                      retries: int | None = None, raise_for_status: bool = True,
                      pieces: PieceOptions | None = None) -> Response:
        """Send one request to ``url`` + ``path`` and return the response.

        ``payload`` may be an :class:`Envelope` (encoded with ``codec``, Content-Format
        60) or raw bytes. Error codes raise unless ``raise_for_status=False``. ``pieces``: see
        the module's docstring.
        """
        if pieces is not None:
            timeout, retries = self._attempt_limits(timeout, retries)
            return await request_in_pieces(self, method, url, path, payload, pieces, timeout, retries,
                                           raise_for_status, codec=codec, content_format=content_format)
        a = self._attempts_of(method, url, path, payload, codec, content_format, timeout, retries, raise_for_status)
        if not query and self._loop is asyncio.get_running_loop():
            lean = self._lean_head(a)
            if lean is not None:  # as a submission, without the attempts' coroutines and message objects
                submission = Submission(self, a, self._loop.create_future())
                submission.go_lean(*lean)
                return await submission.future
        uri_query = tuple(f"{k}={v}" for k, v in (query or {}).items())
        return await self._attempts(a.code, a.url, a.path, a.body, a.content_format, uri_query, a.timeout, a.retries,
                                    a.raise_for_status)

    def submit(self, method: str, url: str, path: str = "", payload: Payload = None, *,
               codec: CodecChoice = None, content_format: int | None = None, timeout: float | None = None,
               retries: int | None = None, pieces: PieceOptions | None = None) -> concurrent.futures.Future[Response]:
        """Send a request from any thread without waiting for it: a future of its response (an error
        code is raised from it, as by :meth:`request`).

        Over an open pooled TCP connection, a payload that fits the peer's Max-Message-Size goes out
        without a coroutine or a task (:mod:`~edgert.transport.submission`): the tensor path's send.
        A small frame over plaintext TCP is written from the calling thread itself.
        Anything else takes :meth:`request`'s path; timeouts, retries and errors are the same.
        """
        written = self._written
        if self._loop is None or written is None:
            raise RuntimeError("start the client on its loop before submitting to it")
        if pieces is not None:  # several requests in turn: a task on the loop
            future = asyncio.run_coroutine_threadsafe(self.request(
                method, url, path, payload, codec=codec, content_format=content_format, timeout=timeout,
                retries=retries, pieces=pieces), self._loop)
            self._in_pieces.add(future)
            future.add_done_callback(self._in_pieces.discard)
            return future
        attempts = self._attempts_of(method, url, path, payload, codec, content_format, timeout, retries)
        submission = Submission(self, attempts)
        lean = self._lean_head(attempts)
        if lean is None:
            self._loop.call_soon_threadsafe(submission.go_slow)
            return submission.future
        connection, token, head = lean
        if connection.write_from_thread(token, head, attempts.body, submission.settle):
            written.add(submission, connection, token)  # its timer is armed in the loop's next round
        else:
            self._loop.call_soon_threadsafe(submission.go_lean, connection, token, head)
        return submission.future

    def _attempts_of(self, method: str, url: str, path: str, payload: Payload, codec: CodecChoice,
                     content_format: int | None, timeout: float | None, retries: int | None,
                     raise_for_status: bool = True) -> Attempts:
        """What every attempt of a request sends, with the client's defaults for what is not given."""
        code = method_code(method)
        body, content_format = _body(payload, codec, content_format)
        timeout, retries = self._attempt_limits(timeout, retries)
        return Attempts(code, url, path, body, content_format, timeout, retries, raise_for_status)

    def _lean_head(self, attempts: Attempts) -> tuple[coap_tcp.LargeTcpConnection, bytes, bytes] | None:
        """(connection, token, frame head) of a request that can go lean now (see :meth:`submit`), else None."""
        code, url, path, content_format = attempts.code, attempts.url, attempts.path, attempts.content_format
        size = sum(map(len, attempts.body))
        key = (code, url, path, content_format)
        resource = self._resources.get(key)
        if resource is None:
            scheme, hostinfo, uri_path = self._resource(url, path)
            if scheme not in ("coap+tcp", TLS_SCHEME) or (scheme == TLS_SCHEME and self._tls_tcp is None):
                return None
            options = Message(code=code)
            options.opt.uri_path = uri_path
            if content_format is not None:
                options.opt.content_format = content_format
            resource = self._resources[key] = (self._pool(scheme)._pool, aiocoap.util.hostportsplit(hostinfo),
                                               options.opt.encode())
        pool, address, options = resource
        connection = pool.get(address)
        if connection is None or not connection.is_open or size + HEAD_SLACK > connection.peer_max_message_size:
            return None
        token = coap_tcp.fast_token()
        return connection, token, frame_head(code, token, options, size)

    def _attempt_limits(self, timeout: float | None, retries: int | None) -> tuple[float, int]:
        timeout = self.config.timeout if timeout is None else timeout
        retries = self.config.retries if retries is None else retries
        if timeout <= 0 or retries < 0:
            raise ValueError(f"timeout must be > 0 and retries >= 0, got timeout={timeout!r} retries={retries!r}")
        return timeout, retries

    def _resource(self, url: str, path: str) -> tuple[str, str, tuple[str, ...]]:
        """(scheme, hostinfo, Uri-Path) of ``url`` + ``path``."""
        scheme, hostinfo, base = self._target(url)
        return scheme, hostinfo, base + tuple(p for p in path.strip("/").split("/") if p) if path else base

    async def _attempts(self, code: Code, url: str, path: str, body: Body, content_format: int | None,
                        uri_query: tuple[str, ...], timeout: float, retries: int, raise_for_status: bool = True,
                        first: int = 0) -> Response:
        """Attempts ``first`` to ``retries`` of a request (a submission made attempt 0 itself)."""
        scheme, hostinfo, uri_path = self._resource(url, path)
        await self.start()
        for attempt in range(first, retries + 1):
            if attempt:
                await asyncio.sleep(self.config.backoff * 2 ** (attempt - 1))
            try:
                async with deadline.timeout(timeout):  # unlike wait_for, no task per attempt
                    response = await self._once(code, scheme, hostinfo, uri_path, uri_query, body, content_format)
            except asyncio.TimeoutError:
                failure: Exception = self.timed_out(code, url, path, timeout, attempt, retries)
            except coap_error.NetworkError as exc:
                failure = self.unreachable(code, url, path, exc, attempt, retries)
            else:
                if response.code not in RETRIED_CODES or attempt == retries:
                    return response.raise_for_status() if raise_for_status else response
                continue
            if attempt == retries:
                raise failure
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def timed_out(code: Code, url: str, path: str, timeout: float, attempt: int, retries: int) -> RequestTimeout:
        """The error of an attempt that got no response in time."""
        return RequestTimeout(f"{code.name} {url}/{path.strip('/')}: no response within {timeout} s "
                              f"(attempt {attempt + 1} of {retries + 1})")

    @staticmethod
    def unreachable(code: Code, url: str, path: str, error: coap_error.NetworkError, attempt: int,
                    retries: int) -> PeerUnreachable:
        """The error of an attempt that the network ended (refused, reset, lost)."""
        detail = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
        failure = PeerUnreachable(f"{code.name} {url}/{path.strip('/')}: {detail} "
                                  f"(attempt {attempt + 1} of {retries + 1})")
        failure.__cause__ = error
        return failure

    async def _once(self, code: Code, scheme: str, hostinfo: str, uri_path: tuple[str, ...],
                    uri_query: tuple[str, ...], body: Body, content_format: int | None) -> Response:
        if scheme in ("coap+tcp", TLS_SCHEME):
            host, port = aiocoap.util.hostportsplit(hostinfo)
            connection = await self._connection(scheme, host, port)
            if sum(map(len, body)) + HEAD_SLACK <= connection.peer_max_message_size:
                message = self._message(code, scheme, hostinfo, uri_path, uri_query, b"", content_format)
                message.remote = connection
                return await self.rest_of_blocks(message, await connection.request(message, body))
        if scheme == "coap" and self.tls is not None and self._oscore is None:
            raise PeerUnreachable(f"coap://{hostinfo} needs OSCORE keys, and {self.tls.path} holds none "
                                  f"(enrolled before coap:// was protected): enrol again, or use {TLS_SCHEME}://")
        joined = body[0] if len(body) == 1 else b"".join(body)
        message = self._message(code, scheme, hostinfo, uri_path, uri_query, joined, content_format)
        response = await self._context.request(message).response
        if scheme == "coap":
            self._udp_remotes[hostinfo] = response.remote
        return Response.from_message(response)

    async def rest_of_blocks(self, request: Message, response: Message | Response) -> Response:
        """``response`` to a fast-path ``request``, with the rest of its Block2 blocks fetched if it has more."""
        if isinstance(response, Response):  # a plain response: no Block2
            return response
        if response.opt.block2 is not None and response.opt.block2.more:
            response = await BlockwiseRequest._complete_by_requesting_block2(
                self._context, request, response, self._context.log)
        return Response.from_message(response)

    def request_message(self, code: Code, url: str, path: str, content_format: int | None,
                        connection: coap_tcp.LargeTcpConnection) -> Message:
        """The request a submission sent over ``connection``, as a message (to fetch Block2 blocks)."""
        scheme, hostinfo, uri_path = self._resource(url, path)
        message = self._message(code, scheme, hostinfo, uri_path, (), b"", content_format)
        message.remote = connection
        return message

    async def _connection(self, scheme: str, host: str, port: int) -> coap_tcp.LargeTcpConnection:
        """The pooled connection to a TCP peer; says so when a plaintext one reached a TLS server."""
        try:
            return await self._pool(scheme).connection(host, port)
        except coap_error.NetworkError as exc:
            connected = not isinstance(exc.__cause__, OSError)  # the peer took the connection, then hung up
            if scheme == "coap+tcp" and connected and await speaks_tls(host, port, self.config.connect_timeout):
                raise PeerUnreachable(f"{format_url(scheme, host, port)}: the peer speaks TLS; reach it at "
                                      f"{format_url(TLS_SCHEME, host, port)} with cluster credentials (or start "
                                      f"it with --insecure for plaintext)") from None
            raise

    def _pool(self, scheme: str) -> coap_tcp_pool.LargeTCPClient:
        if scheme == TLS_SCHEME:
            if self._tls_tcp is None:
                raise PeerUnreachable(f"{TLS_SCHEME}:// needs TLS credentials: "
                                      f"TensorClient(tls=TlsCredentials.load(...))")
            return self._tls_tcp
        return self._tcp

    def _message(self, code: Code, scheme: str, hostinfo: str, uri_path: tuple[str, ...],
                 uri_query: tuple[str, ...], body: coap_tcp.Buffer, content_format: int | None,
                 observe: int | None = None) -> Message:
        if self._context is None:
            raise RuntimeError("client is closed")
        tuning = self._udp_tuning if scheme == "coap" else None
        if scheme == "coap" and isinstance(body, memoryview):
            body = bytes(body)
        message = Message(code=code, payload=body, transport_tuning=tuning)
        message.opt.uri_path = uri_path
        if uri_query:
            message.opt.uri_query = uri_query
        if content_format is not None:
            message.opt.content_format = content_format
        if observe is not None:
            message.opt.observe = observe
        remote = self._udp_remotes.get(hostinfo) if scheme == "coap" else None
        message.remote = remote if remote is not None else UndecidedRemote(scheme, hostinfo)
        return message

    def _target(self, url: str) -> tuple[str, str, tuple[str, ...]]:
        """(scheme, hostinfo, base path) of ``url``, parsed once and cached."""
        target = self._targets.get(url)
        if target is None:
            scheme, host, port = parse_url(url)
            hostinfo = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            path = url.split("://", 1)[1].partition("/")[2].partition("?")[0]
            target = (scheme, hostinfo, tuple(p for p in path.split("/") if p))
            name = urllib.parse.urlsplit(url).username
            if scheme == "coap" and name:
                self._udp_names[hostinfo] = urllib.parse.unquote(name)
            self._targets[url] = target
        return target

    async def get(self, url: str, path: str = "", **kwargs: Any) -> Response:
        """GET ``url``/``path``."""
        return await self.request("GET", url, path, **kwargs)

    async def post(self, url: str, path: str = "", payload: Payload = None, **kwargs: Any) -> Response:
        """POST ``payload`` (envelope or bytes) to ``url``/``path``."""
        return await self.request("POST", url, path, payload, **kwargs)

    async def put(self, url: str, path: str = "", payload: Payload = None, **kwargs: Any) -> Response:
        """PUT ``payload`` to ``url``/``path``."""
        return await self.request("PUT", url, path, payload, **kwargs)

    async def delete(self, url: str, path: str = "", **kwargs: Any) -> Response:
        """DELETE ``url``/``path``."""
        return await self.request("DELETE", url, path, **kwargs)

    async def send(self, url: str, path: str, envelope: Envelope, *, codec: CodecChoice = None,
                   **kwargs: Any) -> Response:
        """POST an envelope (the runtime's main call: activations, gradients, weights, control)."""
        if not isinstance(envelope, Envelope):
            raise TypeError(f"send() takes an Envelope, got {type(envelope).__name__}")
        return await self.request("POST", url, path, envelope, codec=codec, **kwargs)

    async def fetch(self, url: str, path: str, **kwargs: Any) -> Envelope:
        """GET an envelope and decode it with this client's limits."""
        response = await self.request("GET", url, path, **kwargs)
        return response.envelope(self.limits)

    async def discover(self, url: str, **filters: str) -> list[linkformat.Link]:
        """The peer's resources from ``/.well-known/core`` (filters like ``rt="edgert.health"``)."""
        response = await self.request("GET", url, ".well-known/core", query=filters or None)
        try:
            return linkformat.parse(response.text)
        except ValueError as exc:
            raise MalformedMessage(f"{url}: bad link format: {exc}") from None

    def observe(self, url: str, path: str, *, timeout: float | None = None) -> Observation:
        """Observe (RFC 7641) ``url``/``path``: an async iterator of responses, first the current state."""
        return Observation(self, url, path, self.config.timeout if timeout is None else timeout)


def _body(payload: Payload, codec: CodecChoice, content_format: int | None) -> tuple[Body, int | None]:
    """The request body as parts (tensor data and memoryviews referenced, not copied) and its Content-Format."""
    if payload is None:
        return (), content_format
    if isinstance(payload, Envelope):
        parts = tuple(encode_envelope_parts(payload, codec))
        return parts, CONTENT_FORMAT if content_format is None else content_format
    if codec is not None:
        raise ValueError("codec applies to Envelope payloads only; raw bytes are sent as they are")
    if isinstance(payload, (bytes, bytearray)):
        return (payload,), content_format
    if isinstance(payload, memoryview):
        return (payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload,), content_format
    raise TypeError(f"payload must be an Envelope, bytes or None, got {type(payload).__name__}")
