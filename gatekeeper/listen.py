"""Where gatekeeper's servers listen (``proxy``, ``flags serve``, ``review``): ``--listen HOST:PORT`` parsed, and
the socket bound before anything else happens, so a port in use is an error at once and writes nothing."""

from __future__ import annotations

import ipaddress
import socket

from .errors import GatekeeperError


def parse_listen(listen: str, example: str) -> tuple[str, int]:
    """(host, port) of ``HOST:PORT`` or ``PORT`` (host 127.0.0.1); ``example`` is shown when it is neither."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise GatekeeperError(f"--listen {listen!r}: give HOST:PORT or PORT, e.g. {example}")
    return host.strip("[]") or "127.0.0.1", int(port)


def loopback(host: str) -> bool:
    """Whether only this machine can reach ``host`` (a name other than localhost may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(listen: str, example: str) -> socket.socket:
    """The listening socket for ``--listen``, bound (port 0: a free one)."""
    host, port = parse_listen(listen, example)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1" if host == "localhost" else host, port))
    except OSError as e:
        sock.close()
        raise GatekeeperError(f"cannot listen on {host}:{port} ({e.strerror or e}); stop what uses it or pick another "
                              "--listen HOST:PORT") from None
    return sock
