"""systemd's notify protocol (sd_notify): READY, STOPPING and WATCHDOG datagrams to
$NOTIFY_SOCKET. Outside systemd (no NOTIFY_SOCKET) every call does nothing."""

from __future__ import annotations

import os
import socket
from typing import Final

READY: Final = "READY=1"
STOPPING: Final = "STOPPING=1"
WATCHDOG: Final = "WATCHDOG=1"


def notify(message: str, environ: dict[str, str] | None = None) -> bool:
    """Send ``message``; True if a socket was configured and the datagram went out."""
    address = (environ if environ is not None else os.environ).get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket: a leading NUL byte on Linux
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(message.encode(), address)
        except OSError:
            return False  # systemd gone or the socket misconfigured: nothing to tell
    return True


def watchdog_interval(environ: dict[str, str] | None = None) -> float | None:
    """How often to send WATCHDOG=1: half of WatchdogSec=, if systemd asked for it for us."""
    env = environ if environ is not None else os.environ
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1_000_000 / 2
