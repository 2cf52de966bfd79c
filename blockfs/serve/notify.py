"""systemd's readiness protocol (sd_notify(3)) without a dependency: one datagram to ``$NOTIFY_SOCKET``.

A unit with ``Type=notify`` running ``blockfs mount --foreground`` is started (and units ordered after it
run) only once the server sends ``READY=1``, which it does once the mount answers."""

from __future__ import annotations

import os
import socket

__all__ = ["notify"]


def notify(message: str) -> bool:
    """Send ``message`` (``"READY=1"``, ``"STOPPING=1"``, ``"STATUS=..."``) to systemd; False when not
    started by systemd (no ``$NOTIFY_SOCKET``) or the socket is gone."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # the abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message.encode(), address)
    except OSError:
        return False
    return True
