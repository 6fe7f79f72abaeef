"""`outbox web`: the operator console (issue 43; docs/console.md).

- ``auth``: who is signed in (credentials file or a trusted proxy), roles, form tokens.
- ``statements``: the SQL the console issues of its own.
- ``reads``: what the pages read.
- ``bulk``: bulk actions as counted selections and stoppable jobs.
- ``app``: the Console (pool, sign-in, rendering, the checks every POST passes).
- ``pages``: the routes and their handlers; ``create_app``.
- ``serve``: from settings to a running uvicorn, for the command.
- ``templates/``, ``static/``: Jinja2 pages, one stylesheet and one small script.
"""
