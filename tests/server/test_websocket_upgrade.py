"""kvfence serves no WebSocket route, and an upgrade request is an ordinary HTTP request to it.

With uvicorn's default (`ws="auto"`, and the websockets package installed) an upgrade swapped
the connection over to uvicorn's WebSocket protocol, whose end never reached the guarded
protocol's connection_lost: each upgrade left its address one place under the per-address cap
for good, and a few of them locked that address (every client behind a proxy) out (review)."""
from __future__ import annotations

import socket

from server_harness import wait_for

SOURCE = "127.0.0.44"
UPGRADE = (b"GET / HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
           b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n")


def test_a_websocket_upgrade_is_answered_as_http_and_gives_its_place_back(server):
    by_address = server.server.config.http_protocol_class.by_address
    answers = []
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port), timeout=20, source_address=(SOURCE, 0)) as s:
            s.sendall(UPGRADE)
            answers.append(s.recv(200))
    assert wait_for(lambda: SOURCE not in by_address, 10), f"places still held: {by_address.get(SOURCE)}"
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers   # the root route
