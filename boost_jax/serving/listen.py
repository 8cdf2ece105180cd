"""The server's listening socket, bound before anything heavy starts, so a port in use is one message."""

from __future__ import annotations

import socket

from boost_jax.runtime.errors import ConfigError


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or one message: a port in use (or an address not this machine's)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror} (another server on it? pass --port)") from None
    sock.listen(128)
    return sock
