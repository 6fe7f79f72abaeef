"""From `outbox web`'s settings to a served console: the sign-in read, the pool made, uvicorn run.

Imported only by the command, and only with the extra (`pip install 'outbox[web]'`)."""

from __future__ import annotations

import os
from pathlib import Path

import uvicorn

from outbox.config.settings import Settings
from outbox.web.app import Console, Options, open_pool
from outbox.web.auth import Credentials
from outbox.web.pages import create_app


def options(settings: Settings, *, read_only: bool) -> Options:
    """The console's options from the [web] table; the credentials file read now, so that a
    broken one stops the start (CredentialsError) rather than every sign-in."""
    web = settings.web
    credentials = None
    if web.credentials_file is not None:
        path = Path(web.credentials_file)
        directory = os.environ.get("CREDENTIALS_DIRECTORY")
        if directory and not path.is_absolute():
            path = Path(directory) / path
        credentials = Credentials.load(path)
    return Options(
        read_only=read_only or web.read_only,
        credentials=credentials,
        proxy_user_header=web.proxy_user_header,
        proxy_role_header=web.proxy_role_header,
    )


def describe(chosen: Options) -> str:
    """How people sign in, as the start says it."""
    if chosen.proxy_user_header is not None:
        return f"the proxy's {chosen.proxy_user_header} header"
    if chosen.credentials is not None:
        return f"HTTP basic, {len(chosen.credentials)} people in the credentials file"
    return "no one: everyone is a viewer"


def serve(dsn: str, settings: Settings, chosen: Options, host: str, port: int) -> None:
    pooled = settings.database.transaction_pooling
    console = Console(open_pool(dsn, session_settings=not pooled), settings, chosen, dsn=dsn)
    uvicorn.run(create_app(console), host=host, port=port, log_level="warning", access_log=False)
