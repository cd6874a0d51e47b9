"""OSCORE (RFC 8613) for ``coap://``: keys from enrolment, persistent sequence numbers, client and server.

CoAP over UDP between the coordinator and an enrolled device is protected end to end
with OSCORE, using aiocoap's implementation (:mod:`aiocoap.oscore`: key derivation,
COSE protection, the replay window, Appendix B.1 sequence number persistence and Echo
recovery). This module adds what edgert needs around it:

* **Keys and state** (:mod:`edgert.transport.oscore_keys`): pairwise contexts from the
  credentials, found by the ID Context of a request, with sequence numbers and replay
  windows that persist beside the credential.
* **Server** (:class:`OscoreSite`): a UDP request that is not protected, names no known
  context, comes from a revoked or expired device, fails verification or repeats a
  sequence number is answered **4.01** (unprotected, Max-Age 0) and reaches no handler.
* **Client** (:class:`OscoreRequests`): every ``coap://`` request of a client with
  credentials is protected. A worker uses its one context; the coordinator picks the
  device from the URL: ``coap://NAME@host:port``.

aiocoap's own glue (:mod:`aiocoap.transports.oscore`, :mod:`aiocoap.oscore_sitewrapper`)
imports ``lakers`` (EDHOC, a Rust extension) at import time, which edgert neither needs
nor installs on boards; :class:`OscoreRequests` and :class:`OscoreSite` follow those two
closely, without EDHOC, and answer every refusal with 4.01.
"""

from __future__ import annotations

import asyncio
import logging

import aiocoap
from aiocoap import error as coap_error
from aiocoap import interfaces, oscore
from aiocoap.numbers import MAX_REGULAR_BLOCK_SIZE_EXP
from aiocoap.numbers.codes import Code
from aiocoap.pipe import IterablePipe, error_to_message, run_driving_pipe

from edgert.transport.errors import CredentialError, OscoreRefused, OscoreUnverified
from edgert.transport.oscore_keys import OscoreKeys, StoredContext
from edgert.transport.tls import PeerIdentity

log = logging.getLogger("edgert.transport.oscore")
_render_log = logging.getLogger("coap-server.oscore")  # where aiocoap logs rendering (block continuations...)

#: What an unprotected UDP request is told (it reaches no handler).
UNPROTECTED = ("coap:// takes OSCORE-protected requests only (RFC 8613): enrol the device "
               "(edgert keys enroll NAME) and use its credential")


# -- addresses -------------------------------------------------------------------------------


class OscoreAddress(interfaces.EndpointAddress):
    """The remote of a message that travels OSCORE-protected over UDP; ``peer`` is who holds the context."""

    def __init__(self, context: StoredContext, underlying) -> None:
        self.context = context
        self.underlying = underlying

    @property
    def peer(self) -> PeerIdentity:
        return self.context.peer

    def __repr__(self) -> str:
        return f"<OscoreAddress {self.context.peer} at {self.underlying!r}>"

    hostinfo = property(lambda self: self.underlying.hostinfo)
    hostinfo_local = property(lambda self: self.underlying.hostinfo_local)
    uri_base = property(lambda self: self.underlying.uri_base)
    uri_base_local = property(lambda self: self.underlying.uri_base_local)
    scheme = property(lambda self: self.underlying.scheme)
    is_multicast = False
    is_multicast_locally = False
    maximum_payload_size = 1024
    maximum_block_size_exp = MAX_REGULAR_BLOCK_SIZE_EXP

    @property
    def blockwise_key(self):
        return (self.underlying.blockwise_key, self.context.id_context, self.context.recipient_id)


# -- client ----------------------------------------------------------------------------------


class OscoreRequests(interfaces.RequestInterface):
    """Claims every ``coap://`` request of a client with credentials and sends it protected (inner blockwise).

    Modelled on :class:`aiocoap.transports.oscore.TransportOSCORE`; ``names`` maps a hostinfo to the
    device name its URL gave (``coap://NAME@host:port``), which the coordinator needs.
    """

    def __init__(self, wire: aiocoap.Context, keys: OscoreKeys, names: dict[str, str]) -> None:
        self._wire = wire
        self.keys = keys
        self._names = names
        self._tasks: set[asyncio.Task] = set()

    async def fill_or_recognize_remote(self, message: aiocoap.Message) -> bool:
        remote = message.remote
        if isinstance(remote, OscoreAddress):
            return True
        if message.opt.oscore is not None or getattr(remote, "scheme", None) != "coap":
            return False
        message.remote = OscoreAddress(self.keys.for_peer(self._names.get(remote.hostinfo)), remote)
        return True

    def request(self, pipe) -> None:
        task = asyncio.get_running_loop().create_task(self._request(pipe), name=f"OSCORE request {pipe.request!r}")
        self._tasks.add(task)
        pipe.on_interest_end(task.cancel)

        def done(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            if task.cancelled():
                return
            exception = task.exception()
            if exception is not None:
                pipe.add_exception(exception)

        task.add_done_callback(done)

    async def _request(self, pipe) -> None:
        message = pipe.request
        address: OscoreAddress = message.remote
        context = address.context

        def send(echo: bytes | None):
            protected_message = message if echo is None else message.copy(echo=echo)
            with context.lock:
                protected, request_id = context.protect(protected_message)
            protected.remote = address.underlying
            # no outer blockwise: the server verifies whole messages (inner blocks are <= 1024 bytes)
            return self._wire.request(protected, handle_blockwise=False), request_id

        wire, request_id = send(None)
        try:
            response = self._unprotect(await wire.response, context, request_id, address)
            if response.code == Code.UNAUTHORIZED and response.opt.echo is not None:
                log.info("answering the Echo of %s (OSCORE replay window recovery, RFC 8613 B.1.2)", address.peer)
                wire, request_id = send(response.opt.echo)
                response = self._unprotect(await wire.response, context, request_id, address)
            more = response.code.is_successful() and wire.observation is not None \
                and response.opt.observe is not None
            pipe.add_response(response, is_last=not more)
            if not more:
                return
            async for notification in wire.observation:
                response = self._unprotect(notification, context, request_id, address)
                more = response.code.is_successful() and notification.opt.observe is not None
                pipe.add_response(response, is_last=not more)
                if not more:
                    return
            pipe.add_exception(coap_error.ObservationCancelled())
        finally:
            if not wire.response.done():
                wire.response.cancel()
            if wire.observation is not None and not wire.observation.cancelled:
                wire.observation.cancel()
                # aiocoap would drop the token only at the next notification; drop it now, so that the
                # next one is answered with RST (which ends the observation on the server), as without OSCORE
                stop = getattr(wire, "_stop_interest", None)
                if stop is not None:
                    stop()

    @staticmethod
    def _unprotect(protected: aiocoap.Message, context: StoredContext, request_id,
                   address: OscoreAddress) -> aiocoap.Message:
        if protected.opt.oscore is None:
            if protected.code.is_successful():
                raise OscoreUnverified(f"{address.hostinfo} answered an OSCORE request without protection")
            plain = protected.copy()  # the peer has no context for us: its (unauthenticated) refusal
            plain.remote = address
            return plain
        try:
            with context.lock:
                response, _ = context.unprotect(protected, request_id)
        except (oscore.ProtectionInvalid, oscore.ContextUnavailable, ValueError) as error:
            raise OscoreUnverified(f"the response of {address.hostinfo} fails OSCORE verification: "
                                   f"{error or type(error).__name__}") from None
        response.remote = OscoreAddress(context, protected.remote)
        return response

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()


# -- server ----------------------------------------------------------------------------------


class OscoreSite(interfaces.Resource):
    """Verifies OSCORE requests that arrive over UDP and renders them with ``inner``; protects the responses.

    Modelled on :class:`aiocoap.oscore_sitewrapper.OscoreSiteWrapper`. Requests over other
    transports, and unprotected UDP requests, go to ``inner`` unchanged (which answers the latter
    4.01). Any OSCORE failure is answered 4.01 with Max-Age 0 and a diagnostic; the handler never
    runs.
    """

    def __init__(self, inner: interfaces.Resource, keys: OscoreKeys) -> None:
        self._inner = inner
        self.keys = keys
        keys.prepare()

    async def needs_blockwise_assembly(self, request: aiocoap.Message) -> bool:
        return False

    async def render(self, request: aiocoap.Message) -> aiocoap.Message:
        raise NotImplementedError("requests are dispatched by render_to_pipe")

    async def render_to_pipe(self, pipe) -> None:
        request = pipe.request
        if request.opt.oscore is None or getattr(request.remote, "scheme", None) != "coap":
            await self._inner.render_to_pipe(pipe)
            return
        try:
            context, unprotected, request_id = self._verify(request, pipe)
        except OscoreRefused as refused:
            log.info("refused OSCORE request from %s: %s", _hostinfo(request), refused.diagnostic)
            pipe.add_response(refused.to_message(), is_last=True)
            return
        except CredentialError as error:  # our side: the state of that peer's context cannot be kept
            log.error("cannot serve an OSCORE request from %s: %s", _hostinfo(request), error)
            pipe.add_response(aiocoap.Message(code=Code.SERVICE_UNAVAILABLE, max_age=0,
                                              payload=b"the server cannot keep OSCORE state"), is_last=True)
            return
        if context is None:
            return  # answered (Echo)
        unprotected.remote = OscoreAddress(context, request.remote)
        inner_pipe = IterablePipe(unprotected)
        run_driving_pipe(error_to_message(inner_pipe, _render_log), self._inner.render_to_pipe(inner_pipe),
                         name=f"OSCORE rendering of {unprotected!r}")
        async for event in inner_pipe:
            if event.exception is not None:
                log.warning("handler error behind OSCORE: %r", event.exception)
                message, is_last = aiocoap.Message(code=Code.INTERNAL_SERVER_ERROR), True
            else:
                message, is_last = event.message, event.is_last
            if not is_last:
                message.opt.observe = 0
            with context.lock:
                protected, _ = context.protect(message, request_id)
                if message.opt.observe is not None:
                    protected.opt.observe = context.sender_sequence_number & 0xFFFFFF
            pipe.add_response(protected, is_last=is_last)
            if is_last:
                break

    def _verify(self, request: aiocoap.Message, pipe):
        try:
            bag = oscore.verify_start(request)
        except oscore.DecodeError:
            raise OscoreRefused("the OSCORE option is malformed") from None
        if request.code not in (Code.POST, Code.FETCH):
            raise OscoreRefused("an OSCORE request travels as POST or FETCH")
        context = self.keys.for_request(bag)
        try:
            with context.lock:
                unprotected, request_id = context.unprotect(request)
        except oscore.ReplayErrorWithEcho as challenge:  # window unknown after a crash: prove freshness
            with context.lock:
                pipe.add_response(challenge.to_message(), is_last=True)
            return None, None, None
        except oscore.ReplayError:
            raise OscoreRefused("replayed request: its OSCORE sequence number was already used") from None
        except (oscore.ProtectionInvalid, oscore.ContextUnavailable, ValueError, TypeError, IndexError) as error:
            raise OscoreRefused(f"the request fails OSCORE verification ({type(error).__name__})") from None
        return context, unprotected, request_id


def _hostinfo(message: aiocoap.Message) -> str:
    try:
        return message.remote.hostinfo
    except Exception:  # noqa: BLE001  (only for logs)
        return "?"


__all__ = ["OscoreAddress", "OscoreRequests", "OscoreSite", "UNPROTECTED"]
