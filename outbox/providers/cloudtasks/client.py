"""The google-cloud-tasks client of a `cloudtasks` provider: its async client over gRPC, built
for an emulator (plain gRPC to loopback, no credentials) or for the real API (TLS, Google's
default credentials: GOOGLE_APPLICATION_CREDENTIALS, or the metadata server), with the library's
own retries off: outbox retries, with the task-name window in mind.

Every import of the client library goes through here.
"""

from __future__ import annotations

import warnings
from typing import Any, Final

with warnings.catch_warnings():
    # google.api_core and google.cloud.tasks_v2 warn on import about the Python versions they
    # will stop supporting: no concern of an operator's, and an error where warnings are errors.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"google\.")
    import grpc
    from google.api_core import exceptions as gexc
    from google.auth import exceptions as auth_exceptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import tasks_v2
    from google.cloud.tasks_v2.services.cloud_tasks.transports import (
        CloudTasksGrpcAsyncIOTransport,
    )

DEFAULT_ENDPOINT: Final = "cloudtasks.googleapis.com:443"
# How often a broken channel tries to connect again: gRPC's default backs off to 2 minutes, which
# would hold every send transient for that long after a blip; 5 s is one cheap attempt per lease.
_CHANNEL_OPTIONS: Final = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 5000),
    ("grpc.keepalive_time_ms", 30000),
    ("grpc.keepalive_timeout_ms", 10000),
)
CloudTasksAsyncClient = tasks_v2.CloudTasksAsyncClient


def build_client(endpoint: str | None, *, emulator: bool) -> CloudTasksAsyncClient:
    """A client for ``endpoint``; raises google.auth's DefaultCredentialsError when the real API
    has no credentials to use. Call it inside the event loop the client will serve."""
    if emulator:
        if endpoint is None:
            raise ValueError("an emulator needs its endpoint")
        channel = grpc.aio.insecure_channel(endpoint, options=list(_CHANNEL_OPTIONS))
        transport = CloudTasksGrpcAsyncIOTransport(
            channel=channel,
            credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
        )
        return CloudTasksAsyncClient(transport=transport)

    def make_channel(*args: Any, **kwargs: Any) -> grpc.aio.Channel:
        options = [*(kwargs.pop("options", None) or ()), *_CHANNEL_OPTIONS]
        return CloudTasksGrpcAsyncIOTransport.create_channel(*args, options=options, **kwargs)

    transport = CloudTasksGrpcAsyncIOTransport(
        host=endpoint or DEFAULT_ENDPOINT, channel=make_channel
    )
    return CloudTasksAsyncClient(transport=transport)


__all__ = [
    "DEFAULT_ENDPOINT",
    "AnonymousCredentials",
    "CloudTasksAsyncClient",
    "auth_exceptions",
    "build_client",
    "gexc",
    "grpc",
    "tasks_v2",
]
