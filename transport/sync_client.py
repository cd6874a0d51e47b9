"""A blocking client for threads: :class:`SyncClient` over a :class:`TensorClient` whose loop runs in another thread.

Worker threads (ORT compute), tests and tools call it like a function; the requests run on the
client's loop (its own daemon thread, or the runtime's transport loop)::

    with SyncClient.start(ClientConfig(timeout=5)) as client:
        weights = client.fetch("coap+tcp://10.0.0.2:5701", "stage/1/weights")
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from edgert.transport import linkformat
from edgert.transport.client import ClientConfig, Payload, TensorClient
from edgert.transport.envelope import Envelope
from edgert.transport.limits import DEFAULT_LIMITS, Limits
from edgert.transport.message import Response
from edgert.transport.tls import TlsCredentials

T = TypeVar("T")


class SyncClient:
    """A blocking facade over a :class:`TensorClient` on an event loop in another thread.

    ``SyncClient.start()`` runs its own loop thread; ``SyncClient(client, loop)``
    wraps a client whose loop already runs elsewhere (the runtime's transport
    loop). Calls must not come from that loop's own thread.
    """

    def __init__(self, client: TensorClient, loop: asyncio.AbstractEventLoop,
                 thread: threading.Thread | None = None) -> None:
        self.client = client
        self.loop = loop
        self._thread = thread

    @classmethod
    def start(cls, config: ClientConfig = ClientConfig(), limits: Limits = DEFAULT_LIMITS,
              tls: TlsCredentials | None = None) -> SyncClient:
        """A client on a fresh loop in a daemon thread; call :meth:`close` when done."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="edgert-transport", daemon=True)
        thread.start()
        client = TensorClient(config, limits, tls=tls)
        sync = cls(client, loop, thread)
        sync.call(client.start())
        return sync

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the client's loop and wait for it; exceptions re-raise here."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            raise RuntimeError("SyncClient called on its own event loop (it would deadlock); await the TensorClient")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def request(self, method: str, url: str, path: str = "", payload: Payload = None, **kwargs: Any) -> Response:
        """Blocking :meth:`TensorClient.request`."""
        return self.call(self.client.request(method, url, path, payload, **kwargs))

    def get(self, url: str, path: str = "", **kwargs: Any) -> Response:
        """Blocking :meth:`TensorClient.get`."""
        return self.call(self.client.get(url, path, **kwargs))

    def post(self, url: str, path: str = "", payload: Payload = None, **kwargs: Any) -> Response:
        """Blocking :meth:`TensorClient.post`."""
        return self.call(self.client.post(url, path, payload, **kwargs))

    def send(self, url: str, path: str, envelope: Envelope, **kwargs: Any) -> Response:
        """Blocking :meth:`TensorClient.send`."""
        return self.call(self.client.send(url, path, envelope, **kwargs))

    def fetch(self, url: str, path: str, **kwargs: Any) -> Envelope:
        """Blocking :meth:`TensorClient.fetch`."""
        return self.call(self.client.fetch(url, path, **kwargs))

    def discover(self, url: str, **filters: str) -> list[linkformat.Link]:
        """Blocking :meth:`TensorClient.discover`."""
        return self.call(self.client.discover(url, **filters))

    def close(self) -> None:
        """Close the client; stop the loop thread if this object started it."""
        try:
            self.call(self.client.close())
        finally:
            if self._thread is not None:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout=5)
                self.loop.close()
                self._thread = None

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
