"""A TCP proxy on loopback that can partition a link: the network faults of the chaos suite.

Real bytes between real processes pass through it; a test switches its mode:
- `open()`: forward everything;
- `stall()`: keep every connection up but forward nothing, either way (a partition: the
  peers see silence, not a reset; bytes wait in the kernel and flow again on `open()`);
- `stall_after(n)`: forward n more client->server bytes, then stall (cut a transfer midway);
- `reset()`: close every connection at once.
It counts what it forwarded and what it held back, so a test can prove the fault was hit.
"""
from __future__ import annotations

import selectors
import socket
import threading


class FaultyLink:
    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1"):
        self.target = target
        self.listener = socket.create_server((host, 0))
        self.listener.setblocking(False)
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.stalled = False
        self.budget: int | None = None          # client->server bytes still allowed before stalling
        self.forwarded = 0
        self.connections = 0
        self.pairs: dict[socket.socket, socket.socket] = {}
        self.upstream: set[socket.socket] = set()
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="faulty-link", daemon=True)
        self.thread.start()

    # -- modes --------------------------------------------------------------------------------
    def open(self) -> None:
        with self.lock:
            self.stalled, self.budget = False, None
            for s in self.pairs:
                self._watch(s, True)

    def stall(self) -> None:
        with self.lock:
            self._stall()

    def stall_after(self, nbytes: int) -> None:
        with self.lock:
            self.budget = nbytes

    def reset(self) -> None:
        with self.lock:
            for s in list(self.pairs):
                self._close(s)

    def held(self) -> int:
        """Bytes waiting at the proxy that a stall keeps from their destination."""
        total = 0
        with self.lock:
            for s in self.pairs:
                try:
                    total += len(s.recv(1 << 20, socket.MSG_PEEK))
                except OSError:
                    pass
        return total

    def client_ports(self) -> set[int]:
        """Source ports of the connected clients (to find which process is mid-transfer)."""
        with self.lock:
            return {s.getpeername()[1] for s in self.pairs if s not in self.upstream}

    def close(self) -> None:
        self._stop = True
        self.thread.join(5)
        self.reset()
        self.listener.close()

    # -- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            for key, _ in self.sel.select(timeout=0.05):
                sock = key.fileobj
                if sock is self.listener:
                    self._accept()
                    continue
                with self.lock:
                    if sock in self.pairs and not self.stalled:
                        self._pump(sock)

    def _stall(self) -> None:
        """Stop reading: bytes stay in the kernel's buffers, TCP windows close, peers wait."""
        self.stalled = True
        for s in self.pairs:
            self._watch(s, False)

    def _watch(self, sock: socket.socket, on: bool) -> None:
        try:
            if on:
                self.sel.register(sock, selectors.EVENT_READ)
            else:
                self.sel.unregister(sock)
        except (KeyError, ValueError):
            pass

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except BlockingIOError:
            return
        try:
            server = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        with self.lock:
            for s in (client, server):
                s.setblocking(False)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.pairs[client], self.pairs[server] = server, client
            self.upstream.add(server)
            self.connections += 1
            if not self.stalled:
                self._watch(client, True)
                self._watch(server, True)

    def _pump(self, sock: socket.socket) -> None:
        outbound = sock not in self.upstream            # client -> server
        limit = 65536
        if outbound and self.budget is not None:
            if self.budget <= 0:
                self._stall()
                return
            limit = min(limit, self.budget)
        try:
            data = sock.recv(limit)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(sock)
            return
        if outbound and self.budget is not None:
            self.budget -= len(data)
        peer = self.pairs[sock]
        try:
            peer.settimeout(10)                     # a peer that stops reading can't wedge us
            peer.sendall(data)
            peer.setblocking(False)
            self.forwarded += len(data)
        except OSError:
            self._close(sock)

    def _close(self, sock: socket.socket) -> None:
        peer = self.pairs.pop(sock, None)
        for s in (sock, peer):
            if s is None:
                continue
            self.pairs.pop(s, None)
            self.upstream.discard(s)
            self._watch(s, False)
            s.close()
