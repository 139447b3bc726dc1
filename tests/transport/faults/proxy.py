"""A misbehaving TCP proxy, run as its own process, between a subscriber and a publisher.

``python -m tests.transport.faults.proxy LISTEN_HOST TARGET_HOST PORT[,PORT...]`` listens on
``LISTEN_HOST:PORT`` and forwards to ``TARGET_HOST:PORT`` for each port (so the
subscriber, which dials the proxy's host, also reaches the PUB port through it).
Commands on stdin, one per line, answered ``ok <command>`` on stdout:

- ``pass``: forward faithfully
- ``stall``: stop forwarding (both directions; connections stay open, data waits)
- ``truncate``: cut every open connection at once (RST), then forward again
- ``corrupt N``: flip one byte in every N forwarded publisher->subscriber bytes
- ``desync N``: on each open connection to the first port (the ROUTER), slip a frame
  header announcing N MiB between two publisher->subscriber frames, then send
  only a trickle of zeros (what one flipped bit in a length field does): below
  the receiver's ``MAXMSGSIZE`` the stream stays busy but never frames again;
  above it ZeroMQ ends the connection as a protocol error and does not redial
"""

from __future__ import annotations

import random
import select
import socket
import struct
import sys
import threading

__all__ = ["main"]


class FrameCursor:
    """Where the frames of one direction of a ZMTP 3 stream begin (after the greeting)."""

    GREETING = 64

    def __init__(self) -> None:
        self.skip = self.GREETING
        self.head = bytearray()

    def boundaries(self, data: bytes) -> list[int]:
        starts, i = [], 0
        while i < len(data):
            if self.skip:
                take = min(self.skip, len(data) - i)
                self.skip -= take
                i += take
                continue
            if not self.head:
                starts.append(i)
            self.head.append(data[i])
            i += 1
            if len(self.head) == (9 if self.head[0] & 0x02 else 2):
                self.skip = int.from_bytes(self.head[1:], "big")
                self.head = bytearray()
        return starts


class Proxy:
    def __init__(self, listen_host: str, target_host: str, ports: list[int]) -> None:
        self.target_host = target_host
        self.mode = "pass"
        self.corrupt_every = 0
        self.flipped = 0
        self.desynced = 0  # streams broken by ``desync``
        self.desync_mib = 0
        self.lock = threading.Lock()
        self.open: list[socket.socket] = []
        self.rng = random.Random(7)
        self.first_port = ports[0]
        self.desync_pending: set[socket.socket] = set()  # upstream sockets still to break
        self.router_upstreams: set[socket.socket] = set()
        for port in ports:
            server = socket.create_server((listen_host, port), reuse_port=False)
            threading.Thread(target=self._accept, args=(server, port), daemon=True).start()

    def _accept(self, server: socket.socket, port: int) -> None:
        while True:
            client, _ = server.accept()
            try:
                upstream = socket.create_connection((self.target_host, port), timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.open += [client, upstream]
                if port == self.first_port:
                    self.router_upstreams.add(upstream)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        pairs = {client: upstream, upstream: client}
        cursor, broken = FrameCursor(), False
        try:
            while True:
                if self.mode == "stall":
                    threading.Event().wait(0.02)
                    continue
                readable, _, _ = select.select(list(pairs), [], [], 0.05)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is upstream and broken:
                        data = bytes(min(len(data), 8))  # busy, but never a whole frame
                    elif sock is upstream:
                        starts = cursor.boundaries(data)
                        if starts and upstream in self.desync_pending:
                            self.desync_pending.discard(upstream)
                            data = data[: starts[0]] + b"\x02" + \
                                (self.desync_mib << 20).to_bytes(8, "big")
                            broken = True
                            self.desynced += 1
                    if sock is upstream and self.mode == "corrupt" and self.corrupt_every:
                        data = self._corrupt(bytearray(data))
                    pairs[sock].sendall(data)
        except (OSError, ValueError):  # ValueError: a socket closed by ``truncate``
            return
        finally:
            self.router_upstreams.discard(upstream)
            for sock in pairs:
                sock.close()

    def _corrupt(self, data: bytearray) -> bytes:
        for index in range(len(data)):
            if self.rng.randrange(self.corrupt_every) == 0:
                data[index] ^= 0xFF
                self.flipped += 1
        return bytes(data)

    def truncate(self) -> None:
        with self.lock:
            victims, self.open = self.open, []
        for sock in victims:
            try:  # RST instead of a clean FIN: the peer sees the connection torn
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
            except OSError:
                pass


def main() -> None:
    listen_host, target_host, ports = sys.argv[1], sys.argv[2], sys.argv[3]
    proxy = Proxy(listen_host, target_host, [int(p) for p in ports.split(",")])
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command:
            continue
        if command[0] == "truncate":
            proxy.truncate()
        elif command[0] == "desync":
            proxy.desync_mib = int(command[1])
            with proxy.lock:
                proxy.desync_pending = set(proxy.router_upstreams)
        elif command[0] == "corrupt":
            proxy.corrupt_every = int(command[1])
            proxy.mode = "corrupt"
        else:
            proxy.mode = command[0]
        print(f"ok {' '.join(command)} flipped={proxy.flipped} desynced={proxy.desynced}",
              flush=True)


if __name__ == "__main__":
    main()
