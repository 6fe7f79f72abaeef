"""Which failed connections `outbox run` refuses at once and which it waits for (issue 38, item 5).

libpq gives no SQLSTATE for a failed connection, only the server's words: these are the messages
PostgreSQL and libpq write, as psycopg raises them (one host, or several). A run that exits 2 is
not restarted by systemd, so anything not known to be lasting must be waited for.
"""

from __future__ import annotations

import psycopg
import pytest

from outbox.daemon.startup import failure_reason, will_not_change

AT = 'connection failed: connection to server at "10.0.0.5", port 5432 failed: '


def failed(message: str) -> psycopg.OperationalError:
    return psycopg.OperationalError(message)


def several(*failures: str) -> psycopg.OperationalError:
    """psycopg's message after trying several hosts: the last failure, then each of them."""
    items = "".join(
        f"\n- host: 'db{n}', port: '5432', hostaddr: '10.0.0.{n}': {f}"
        for n, f in enumerate(failures)
    )
    return failed(f"{failures[-1]}\nMultiple connection attempts failed. All failures were:{items}")


LASTING = [
    'FATAL:  database "app" does not exist',
    'FATAL:  role "outbox" does not exist',
    'FATAL:  password authentication failed for user "outbox"',
    'FATAL:  Ident authentication failed for user "outbox"',
    'FATAL:  role "outbox_dispatcher" is not permitted to log in',
    'FATAL:  no pg_hba.conf entry for host "10.0.0.9", user "outbox", database "app", no '
    "encryption",
    'FATAL:  permission denied for database "app"\nDETAIL:  User does not have CONNECT privilege.',
    "fe_sendauth: no password supplied",
]
PASSING = [
    "Connection refused\n\tIs the server running on that host and accepting TCP/IP connections?",
    "FATAL:  the database system is starting up",
    "FATAL:  the database system is in recovery mode",
    "FATAL:  the database system is shutting down",
    "FATAL:  sorry, too many clients already",
    "FATAL:  remaining connection slots are reserved for roles with the SUPERUSER attribute",
    "timeout expired",
    "server closed the connection unexpectedly",
    # The same refusal in the server's German: not recognised, so waited for.
    "FATAL:  Datenbank »app« existiert nicht",
]


@pytest.mark.parametrize("message", LASTING)
def test_a_lasting_refusal_ends_the_run_at_once(message: str) -> None:
    assert will_not_change(failed(AT + message))


@pytest.mark.parametrize("message", PASSING)
def test_anything_else_is_waited_for(message: str) -> None:
    assert not will_not_change(failed(AT + message))


def test_a_name_that_does_not_resolve_yet_is_waited_for() -> None:
    assert not will_not_change(failed("failed to resolve host 'db': [Errno -2] Name not known"))
    assert not will_not_change(failed(""))


def test_with_several_hosts_only_when_each_refused_for_good() -> None:
    gone = AT + 'FATAL:  database "app" does not exist'
    down = AT + "Connection refused"
    assert will_not_change(several(gone, gone))
    # A primary that is down while a standby says "no such database": wait for the primary.
    assert not will_not_change(several(down, gone))
    assert not will_not_change(several(gone, down))


def test_the_reason_is_one_line_per_host_without_the_password() -> None:
    dsn = "host=db user=outbox password=s3cret-pw dbname=app"
    assert failure_reason(failed(AT + "timeout expired"), dsn) == AT + "timeout expired"
    down = AT + "Connection refused\n\tIs the server running on that host?"
    told = failure_reason(several(down, AT + "FATAL:  leaked s3cret-pw"), dsn)
    assert "\n" not in told and "s3cret-pw" not in told
    assert told.count("connection failed") == 2 and told.startswith("host: 'db0'")
    assert failure_reason(failed(""), dsn) == "OperationalError"
