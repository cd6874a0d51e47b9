"""The server side: named resources over CoAP-over-TCP and CoAP-over-UDP, discoverable and robust.

A :class:`TensorServer` binds one or more URLs (``coap+tcp://host:port``,
``coap://host:port``; port 0 picks a free port, see :attr:`TensorServer.urls`),
serves ``/.well-known/core`` (RFC 6690, with ``rt=`` types) and dispatches each
request to a handler registered per path and method (a coroutine function, or a plain
function answered without a task: see :mod:`~edgert.transport.endpoint`)::

    server = TensorServer("coap+tcp://127.0.0.1:0", "coap://127.0.0.1:0")
    server.add_resource("stage/1/activations", post=on_activations,
                        rt="edgert.activations", kinds=("activations",))
    health = server.add_observable("health", rt="edgert.health")
    await server.start()
    health.notify(Envelope("health", meta={"load": 0.3}))

With :class:`~edgert.transport.tls.TlsCredentials` a server also binds ``coaps+tcp://``
(mutual TLS); a request over it from a peer without a valid, unrevoked cluster
credential is answered 4.01 whatever it asks, and ``roles`` on a resource limits
which roles may call it (4.03 for others). With credentials, ``coap://`` takes only
OSCORE-protected requests (:mod:`edgert.transport.oscore`); any other gets 4.01.

Every bad request is answered with its code and a diagnostic text and the server
keeps serving: unknown path 4.04, wrong method 4.05, malformed CBOR or envelope
4.00, over a size limit 4.13 (with Size1), foreign Content-Format or codec 4.15,
handler exception 5.00.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any

import aiocoap
from aiocoap import Message, interfaces
from aiocoap import error as coap_error
from aiocoap.messagemanager import MessageManager
from aiocoap.tokenmanager import TokenManager
from aiocoap.transports.udp6 import MessageInterfaceUDP6

from edgert.transport import coap_tcp, coap_tcp_pool, linkformat
from edgert.transport.coap_tcp import TLS_SCHEME
from edgert.transport.endpoint import Answer, Endpoint, Handler, HandlerResult, ObservableEndpoint
from edgert.transport.envelope import CONTENT_FORMAT, encode_envelope_parts
from edgert.transport.errors import (
    NotFound,
    ResponseError,
    Unauthorized,
)
from edgert.transport.guard import ConnectionGuard
from edgert.transport.incoming import IncomingMessage
from edgert.transport.limits import DEFAULT_LIMITS, Limits
from edgert.transport.message import Request, Response
from edgert.transport.observe import Observable
from edgert.transport.oscore import UNPROTECTED, OscoreAddress, OscoreSite
from edgert.transport.oscore_keys import OscoreKeys
from edgert.transport.pieces import PIECE_PATH, read_piece_request
from edgert.transport.tls import TlsCredentials
from edgert.transport.transfers import Admission, Transfers
from edgert.transport.urls import format_url, parse_url

log = logging.getLogger("edgert.transport.server")

METHODS = ("GET", "POST", "PUT", "DELETE", "FETCH")
WELL_KNOWN_CORE = ".well-known/core"


class TensorServer:
    """A CoAP server for edgert resources; start with :meth:`start`, stop with :meth:`shutdown`."""

    def __init__(self, *binds: str, limits: Limits = DEFAULT_LIMITS, tls: TlsCredentials | None = None) -> None:
        if not binds:
            raise ValueError("TensorServer needs at least one bind URL, e.g. 'coap+tcp://127.0.0.1:0'")
        self._binds = [parse_url(url) for url in binds]
        if tls is None and any(scheme == TLS_SCHEME for scheme, _, _ in self._binds):
            raise ValueError(f"binding {TLS_SCHEME}:// needs TLS credentials (tls=TlsCredentials.load(...))")
        self.limits = limits
        self.tls = tls
        self._endpoints: dict[tuple[str, ...], Endpoint] = {}
        self._context: aiocoap.Context | None = None
        self._oscore: OscoreKeys | None = None
        self._guard: ConnectionGuard | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self.urls: list[str] = []
        self._add_endpoint(Endpoint(self, WELL_KNOWN_CORE, {"GET": self._well_known_core}, rt=None,
                                     envelope=False, kinds=None, title=None, roles=None))
        self.transfers = Transfers(limits)
        """The bodies this server receives and answers in pieces (transport/pieces.py)."""
        self._add_endpoint(Endpoint(self, PIECE_PATH, {"FETCH": self._next_piece}, rt="edgert.piece",
                                     envelope=True, kinds=("control",), title="pieces of large answers",
                                     roles=None))

    # -- resources ------------------------------------------------------------

    def add_resource(self, path: str, *, get: Handler | None = None, post: Handler | None = None,
                     put: Handler | None = None, delete: Handler | None = None,
                     fetch: Handler | None = None, rt: str, envelope: bool = True,
                     kinds: Iterable[str] | None = None, title: str | None = None,
                     roles: Iterable[str] | Mapping[str, Iterable[str]] | None = None,
                     pieces: Admission | None = None, piece_answers: bool = False) -> None:
        """Serve ``path`` with one handler per method; other methods get 4.05.

        With ``envelope=True`` a request payload must be an envelope (Content-Format
        60 or none) and arrives decoded as ``request.envelope``; ``kinds`` restricts
        the envelope kinds accepted. ``rt`` is the resource type in link format.
        ``roles`` restricts which peer roles may call it over TLS, for every method or per
        method (``{"PUT": ("coordinator",)}``); others get 4.03. ``pieces`` admits a request body sent in
        pieces (given its first piece, where the body goes, or a refusal; docs/PROTOCOL.md §12): the handler
        gets the whole body once it arrived and its digest matched. ``piece_answers``: an envelope answer
        larger than a piece goes in pieces, fetched from ``FETCH /piece``.
        """
        handlers = {m: h for m, h in (("GET", get), ("POST", post), ("PUT", put), ("DELETE", delete),
                                      ("FETCH", fetch)) if h is not None}
        if not handlers:
            raise ValueError(f"resource {path!r} needs at least one handler (get/post/put/delete/fetch)")
        self._add_endpoint(Endpoint(self, path, handlers, rt=rt, envelope=envelope,
                                     kinds=None if kinds is None else tuple(kinds), title=title,
                                     roles=_roles_by_method(roles, handlers), pieces=pieces,
                                     piece_answers=piece_answers))

    def add_observable(self, path: str, *, rt: str, get: Handler | None = None,
                       initial: HandlerResult = None, title: str | None = None) -> Observable:
        """Serve an observable (RFC 7641) resource; returns the :class:`Observable` used to notify.

        Without ``get`` the resource serves the latest value given to
        :meth:`Observable.notify` (``initial`` until then).
        """
        endpoint = ObservableEndpoint(self, path, {}, rt=rt, envelope=False, kinds=None, title=title, roles=None)
        observable = Observable(endpoint, initial)
        endpoint.handlers["GET"] = get or observable._latest_value
        self._add_endpoint(endpoint)
        return observable

    def remove_resource(self, path: str) -> None:
        """Stop serving ``path`` (4.04 afterwards)."""
        key = _split_path(path)
        if key not in self._endpoints or path.strip("/") == WELL_KNOWN_CORE:
            raise KeyError(f"no removable resource at {path!r}")
        del self._endpoints[key]

    def _add_endpoint(self, endpoint: Endpoint) -> None:
        key = _split_path(endpoint.path)
        if key in self._endpoints:
            raise ValueError(f"a resource is already registered at /{endpoint.path}")
        self._endpoints[key] = endpoint

    def links(self) -> list[linkformat.Link]:
        """The link-format entries of all resources (what ``/.well-known/core`` serves)."""
        return [endpoint.link() for key, endpoint in sorted(self._endpoints.items())
                if endpoint.path not in (WELL_KNOWN_CORE, PIECE_PATH)]  # the transport's own, on every server

    def _next_piece(self, request: Request) -> Response:
        """``FETCH /piece``: the next piece of a body this server answers in pieces to the requester."""
        transfer, offset = read_piece_request(request.envelope)
        piece = self.transfers.next_piece(request.sender, transfer, offset)
        return Response(content_format=CONTENT_FORMAT, parts=tuple(encode_envelope_parts(piece)))

    async def _well_known_core(self, request: Request) -> Response:
        filters = dict(request.query)
        links = [link for link in self.links() if linkformat.matches(link, filters)]
        return Response(payload=linkformat.render(links).encode(), content_format=linkformat.CONTENT_FORMAT)

    # -- lifecycle ------------------------------------------------------------

    async def start(self) -> TensorServer:
        """Bind every URL; afterwards :attr:`urls` holds them with the actual ports."""
        if self._context is not None:
            raise RuntimeError("server already started")
        loop = asyncio.get_running_loop()
        self._loop = loop
        site: interfaces.Resource = _Root(self)
        if self.tls is not None and any(scheme == "coap" for scheme, _, _ in self._binds):
            self._oscore = OscoreKeys(self.tls)  # coap:// with credentials: OSCORE
            site = OscoreSite(site, self._oscore)
        context = aiocoap.Context(loop=loop, serversite=site, loggername="coap-server")
        self._context = context
        self._guard = ConnectionGuard(self.limits)
        trust = None if self.tls is None else (lambda peer: self.tls.check(peer) is None)
        try:
            for scheme, host, port in self._binds:
                if scheme in ("coap+tcp", TLS_SCHEME):
                    server = await coap_tcp_pool.add_tcp_server(
                        context, host, port, limits=self.limits, guard=self._guard,
                        fast_server=self._fast_dispatch, screen=self._screen, trust=trust,
                        ssl_context=self.tls.server_context if scheme == TLS_SCHEME else None)
                    bound = server.port
                else:
                    bound = await _add_udp_server(context, host, port)
                self.urls.append(format_url(scheme, host, bound))
        except (OSError, coap_error.NetworkError) as error:  # the port is taken, the address is not this host's
            await self.shutdown()
            errno = getattr(error, "errno", None)
            reason = os.strerror(errno) if (errno or 0) > 0 else getattr(error, "strerror", None) or str(error)
            raise OSError(errno, f"cannot listen on {format_url(scheme, host, port)}: {reason}") from error
        except BaseException:
            await self.shutdown()
            raise
        log.info("serving %s", ", ".join(self.urls))
        return self

    def url(self, scheme: str | None = None) -> str:
        """The first bound URL of ``scheme`` (default: coaps+tcp with credentials, else coap+tcp)."""
        if scheme is None:
            scheme = TLS_SCHEME if self.tls is not None else "coap+tcp"
        for url in self.urls:
            if url.startswith(scheme + "://"):
                return url
        raise KeyError(f"server has no {scheme} binding (bound: {self.urls})")

    async def shutdown(self) -> None:
        """Close every listener and connection; idempotent."""
        context, self._context = self._context, None
        self.urls = []
        self.transfers.close()
        for task in list(self._tasks):
            task.cancel()
        if context is not None and context.request_interfaces:  # aiocoap fails on a context with none
            await context.shutdown()
        guard, self._guard = self._guard, None
        if guard is not None:
            await guard.close()
        oscore, self._oscore = self._oscore, None
        if oscore is not None:
            oscore.close()

    def refusal(self, remote: Any) -> Unauthorized | None:
        """4.01 for a request over TLS or UDP from a peer (its connection or aiocoap remote) without a valid,
        unrevoked cluster credential."""
        if self.tls is None:
            return None
        if isinstance(remote, OscoreAddress):
            reason = self.tls.check(remote.peer)
        elif isinstance(remote, coap_tcp.LargeTcpConnection):
            if remote.scheme != TLS_SCHEME:
                return None
            reason = self.tls.check(remote.peer)
        elif getattr(remote, "scheme", None) == "coap":
            reason = UNPROTECTED  # UDP without OSCORE
        else:
            return None
        return None if reason is None else Unauthorized(reason)

    @property
    def unverified_connections(self) -> int:
        """Open TCP connections of peers without a verified cluster credential (bounded by ``max_connections``)."""
        return 0 if self._guard is None else self._guard.unverified_connections

    # -- TCP: screening and the fast path -----------------------------------------

    def _screen(self, connection: coap_tcp.LargeTcpConnection, request: IncomingMessage) -> Message | None:
        """The answer to a TCP request that is refused from its head alone, so its payload is never stored.

        Identity (4.01), path (4.04), method (4.05), role (4.03) and Content-Format (4.15) are
        known before the payload; None lets the payload in.
        """
        refusal: ResponseError | None = self.refusal(request.remote)
        if refusal is None:
            endpoint = self._endpoints.get(request.path)
            try:
                if endpoint is None:
                    raise _not_found(request.path)
                endpoint.check_head(request)
            except ResponseError as error:
                refusal = error
        if refusal is None:
            return None
        log.info("refused %s /%s from %s before its payload: %s", request.code.name, "/".join(request.path),
                 request.peer_name, refusal)
        return refusal.to_message()

    def _fast_dispatch(self, connection: coap_tcp.LargeTcpConnection, incoming: Message | IncomingMessage) -> bool:
        """Serve a plain TCP request without aiocoap's per-request machinery; False = not eligible.

        A refusal, and the response of a handler that is a plain function, are written from this
        callback; a coroutine handler (or a response needing Block2) finishes in a task.
        """
        if self._context is None:
            return False
        if isinstance(incoming, Message):  # options beyond the plain ones: serve those aiocoap need not
            options = incoming.opt
            if (options.observe is not None or options.block1 is not None or options.block2 is not None
                    or options.no_response is not None or options.uri_path_abbrev is not None):
                return False
            incoming = IncomingMessage.of(incoming)
        endpoint = self._endpoints.get(incoming.path)
        refusal = self.refusal(incoming.remote)
        if refusal is not None:
            log.info("refused %s from %s: %s", "/".join(incoming.path), incoming.peer_name, refusal)
            answer: Answer | Awaitable[Answer] = refusal.to_message()
        elif endpoint is None:
            answer = _not_found(incoming.path).to_message()
        else:
            answer = endpoint.start(incoming)
        if isinstance(answer, (Response, Message)) and not self._needs_blocks(connection, endpoint, answer):
            _answer(connection, incoming, answer)
            return True
        task = asyncio.get_running_loop().create_task(self._finish(connection, incoming, endpoint, answer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    @staticmethod
    def _needs_blocks(connection: coap_tcp.LargeTcpConnection, endpoint: Endpoint | None, response: Answer) -> bool:
        """Whether a success is larger than the peer takes in one message (served as Block2, like aiocoap)."""
        return (endpoint is not None and isinstance(response, Response) and response.ok
                and len(response.payload) > connection.maximum_payload_size
                and not connection.fits(response.to_message()))

    async def _finish(self, connection: coap_tcp.LargeTcpConnection, incoming: IncomingMessage,
                      endpoint: Endpoint | None, answer: Answer | Awaitable[Answer]) -> None:
        response = answer if isinstance(answer, (Response, Message)) else await answer
        if not self._needs_blocks(connection, endpoint, response):
            _answer(connection, incoming, response)
            return
        whole = response.to_message()

        async def rendered() -> Message:
            return whole

        _answer(connection, incoming, await endpoint._block2.extract_or_insert(incoming.to_message(), rendered))

    async def __aenter__(self) -> TensorServer:
        return await self.start()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.shutdown()


class _Root(interfaces.Resource):
    """Dispatches on the whole Uri-Path without copying the request (aiocoap's Site deep-copies options)."""

    def __init__(self, server: TensorServer) -> None:
        super().__init__()
        self._server = server

    async def needs_blockwise_assembly(self, request: Message) -> bool:
        return False

    async def render(self, request: Message) -> Message:
        raise NotImplementedError("requests are dispatched by render_to_pipe")

    async def render_to_pipe(self, pipe) -> None:
        refusal = self._server.refusal(pipe.request.remote)
        if refusal is not None:
            pipe.add_response(refusal.to_message(), is_last=True)
            return
        path = tuple(pipe.request.opt.uri_path)
        endpoint = self._server._endpoints.get(path)
        if endpoint is None:
            pipe.add_response(_not_found(path).to_message(), is_last=True)
            return
        await endpoint.render_to_pipe(pipe)


# -- helpers ----------------------------------------------------------------------


async def _add_udp_server(context: aiocoap.Context, host: str, port: int) -> int:
    """Attach a udp6 server transport bound to (host, port) without SO_REUSEPORT; returns the port."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, family=socket.AF_INET6, type=socket.SOCK_DGRAM,
                                   flags=socket.AI_V4MAPPED)
    if not infos:
        raise OSError(f"no address to bind for {host!r}")
    sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(infos[0][4])
    except OSError:
        sock.close()
        raise
    tokens = TokenManager(context)
    messages = MessageManager(tokens)
    transport = await MessageInterfaceUDP6._create_transport_endpoint(sock, messages, context.log, loop)
    messages.message_interface = transport
    tokens.token_interface = messages
    context.request_interfaces.append(tokens)
    return sock.getsockname()[1]


def _roles_by_method(roles: Iterable[str] | Mapping[str, Iterable[str]] | None,
                     handlers: dict[str, Handler]) -> dict[str, tuple[str, ...]] | None:
    if roles is None:
        return None
    if isinstance(roles, Mapping):
        unknown = set(roles) - set(handlers)
        if unknown:
            raise ValueError(f"roles given for methods without a handler: {', '.join(sorted(unknown))}")
        return {method: tuple(names) for method, names in roles.items()}
    names = tuple(roles)
    return {method: names for method in handlers}


def _answer(connection: coap_tcp.LargeTcpConnection, request: IncomingMessage, response: Answer) -> None:
    """Send ``response`` to ``request`` (a diagnostic too large for the peer is shortened to fit)."""
    try:
        if isinstance(response, Response) and response.parts is not None:
            connection.send_frame(response.code, request.token, response.options, response.parts)
            return
        if isinstance(response, Response) and len(response.payload) <= connection.maximum_payload_size:
            connection.send_frame(response.code, request.token, response.options, response.payload)
            return
        message = response if isinstance(response, Message) else response.to_message()
        message.token = request.token
        connection.send_signal(message)
    except aiocoap.error.NetworkError:
        log.info("peer %s left before its response", request.peer_name)


def _not_found(path: Iterable[str]) -> NotFound:
    return NotFound(f"no resource at /{'/'.join(path)}; GET /.well-known/core lists the resources")


def _split_path(path: str) -> tuple[str, ...]:
    if not isinstance(path, str) or not path.strip("/"):
        raise ValueError(f"resource path must be a non-empty str like 'stage/1/activations', got {path!r}")
    return tuple(path.strip("/").split("/"))


