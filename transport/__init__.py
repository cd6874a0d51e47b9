"""edgert.transport: every byte between devices (tensors, weights, control, health) over CoAP + CBOR.

Map of the package (wire format: docs/PROTOCOL.md):

- ``envelope.py``     :class:`Envelope`, :func:`encode_envelope`, :func:`decode_envelope`: the message
- ``tensor.py``       RFC 8746 typed arrays in tag 40: zero-copy tensor encode/decode, dtype table
- ``pieces.py``       bodies in pieces: the ``piece`` format, :class:`Outgoing`, :class:`Incoming`, the sinks
- ``transfers.py``    :class:`Transfers` (a server's bodies in pieces, bounded), :class:`PieceOptions`, sends
- ``codec.py``        compression codecs ``none``/``fp16``/``int8``/``int4``/``topk``, :func:`get_codec`
- ``cbor.py``         the CBOR subset (zero-copy byte strings, strict limits) under both of the above
- ``limits.py``       :class:`Limits`: declared size and structure caps (4.13 / 4.00), connection limits
- ``errors.py``       :class:`TransportError`, the CoAP-coded errors (``NotFound`` = 4.04 ...), credential errors
- ``message.py``      :class:`Request` (what handlers get) and :class:`Response` (what both sides return)
- ``server.py``       :class:`TensorServer`: resources, ``/.well-known/core``, TCP screening, OSCORE/TLS refusals
- ``endpoint.py``     one served path: head checks (method, role, Content-Format), size, envelope, handler
- ``urls.py``         :func:`parse_url`, :func:`format_url`: the one parser of the URLs edgert takes
- ``client.py``       :class:`TensorClient` (async, and ``submit`` from any thread), :class:`ClientConfig`
- ``sync_client.py``  :class:`SyncClient`: a blocking client for threads, over a TensorClient on another loop
- ``submission.py``   :class:`Submission`: a request handed over from another thread with no task (the tensor path)
- ``observe.py``      RFC 7641: :class:`Observation` (client side), :class:`Observable` (server side)
- ``linkformat.py``   RFC 6690 link format: :class:`Link`, render, parse
- ``coap_tcp.py``     CoAP over TCP with negotiated large messages (aiocoap transport subclass), ``DEFAULT_PORT``
- ``coap_tcp_pool.py`` its listening and connecting sides: the server (port 0, the guard), the client pool
- ``frame_reader.py`` receiving RFC 8323 frames: heads screened first, buffers that grow with the bytes
- ``incoming.py``     :class:`IncomingMessage`: a plain request or response read off a frame without aiocoap
- ``framing.py``      RFC 8323 framing at the byte level (frame length, options, frame head)
- ``guard.py``        what peers can make a server hold: connection cap, unverified-bytes budget, timeouts
- ``deadline.py``     ``timeout``: bounding an awaited block on Python 3.10 and newer
- ``tls.py``          credentials (:class:`TlsCredentials`), the TLS contexts of ``coaps+tcp``, revocation
- ``oscore.py``       OSCORE for ``coap://``: the protecting client and the 4.01-answering server
- ``oscore_keys.py``  OSCORE contexts from enrolment, with persistent sequence numbers and replay windows

Of ``edgert`` it imports only ``edgert.errors``.
"""

from edgert.transport.client import ClientConfig, TensorClient
from edgert.transport.codec import Codec, get_codec
from edgert.transport.envelope import (
    CONTENT_FORMAT,
    KINDS,
    Envelope,
    decode_envelope,
    encode_envelope,
    encode_envelope_parts,
)
from edgert.transport.errors import (
    BadRequest,
    Incomplete,
    InternalServerError,
    MalformedMessage,
    MethodNotAllowed,
    NotFound,
    PeerUnreachable,
    RequestTimeout,
    ResponseError,
    ServiceUnavailable,
    TooLarge,
    TransportError,
    UnsupportedCodec,
    UnsupportedContentFormat,
)
from edgert.transport.limits import DEFAULT_LIMITS, Limits
from edgert.transport.linkformat import Link
from edgert.transport.message import Request, Response
from edgert.transport.observe import Observable, Observation
from edgert.transport.server import TensorServer
from edgert.transport.sync_client import SyncClient
from edgert.transport.tensor import DTYPES, decode_tensor, encode_tensor
from edgert.transport.transfers import PieceOptions

__all__ = [
    "BadRequest", "CONTENT_FORMAT", "Incomplete", "ClientConfig", "Codec", "DEFAULT_LIMITS", "DTYPES",
    "Envelope", "InternalServerError", "KINDS", "Limits", "Link", "MalformedMessage", "MethodNotAllowed",
    "NotFound", "Observable", "Observation", "PeerUnreachable", "Request", "RequestTimeout", "Response",
    "ResponseError", "ServiceUnavailable", "SyncClient", "TensorClient", "TensorServer", "TooLarge",
    "TransportError", "UnsupportedCodec", "UnsupportedContentFormat", "decode_envelope", "decode_tensor",
    "encode_envelope", "encode_envelope_parts", "encode_tensor", "get_codec", "PieceOptions",
]
