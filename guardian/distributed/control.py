"""The group's control connections: rank 0 and each other rank watch each other.

A TCP connection from each rank to rank 0, beside (never inside) the
backend's own. Each end sends a beat every ``beat_s`` and says why it
leaves (``failing`` with a reason, or ``stopping``). The other end treats
the connection closing (the process died: the kernel closes its sockets,
even after SIGKILL), a ``failing`` line, or silence for ``peer_timeout_s``
(a stopped or wedged process) as the loss of that rank. What a collective
cannot do, wait with a bound, this does.

One JSON object a line: ``{"kind": "hello", "rank": 1, "token": ...}``
first from a joining rank, then ``beat``, ``failing`` (with ``reason``) or
``stopping``. Rank 0 listens on the network until every rank has joined: a
hello without the token the rendezvous gave the group's members, or that
names no rank still to join, is refused and its connection closed.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import selectors
import socket
import threading
import time
from typing import Callable, Optional

import structlog

from guardian.config.tables import WatchdogSettings

log = structlog.get_logger("guardian.group")

# How long rank 0 waits for every other rank to connect, and a rank for rank 0 to
# accept, by default: they passed the rendezvous together moments before.
JOIN_TIMEOUT_S = WatchdogSettings.join_timeout_s.default
# A hello is a line of a few dozen bytes: a longer one is no rank's.
MAX_HELLO_BYTES = 4096
# After an accept that failed, before the next (the listener stays readable).
ACCEPT_RETRY_S = 0.1
# Connections whose hello is still to come, at most: past it the oldest goes (a rank
# sends its hello as it connects; a flood of silent ones must not hold their descriptors).
MAX_PENDING_HELLOS = 64

# (rank, why) -> None: called once per lost rank, on a reader thread.
OnLost = Callable[[int, str], None]


class Connection:
    """One control connection, to the rank ``peer``: lines out, a reader thread in."""

    def __init__(self, sock: socket.socket, peer: int, peer_timeout_s: float,
                 on_lost: OnLost, on_stopping: Callable[[int], None], hello: Optional[dict] = None):
        self.sock = sock
        self.peer = peer
        # Where the peer runs (its hello): a rank on this machine can be killed.
        self.peer_pid = (hello or {}).get("pid")
        self.peer_host = (hello or {}).get("host")
        # Set once the peer's end closed: its process is gone.
        self.gone = threading.Event()
        # When a line of the peer's last came (its beats included): the status's view of it.
        self.last_heard = time.monotonic()
        # The peer (a rank other than 0) asked rank 0 to stop the group.
        self.asked = False
        self._peer_timeout_s = peer_timeout_s
        self._on_lost = on_lost
        self._on_stopping = on_stopping
        self._send_lock = threading.Lock()
        self.closed = False

    def start(self, reader: Optional[socket.SocketIO] = None) -> None:
        self.sock.settimeout(self._peer_timeout_s)
        threading.Thread(target=self._read, args=(reader or self.sock.makefile("rb"),),
                         name=f"group-rank-{self.peer}", daemon=True).start()

    def send(self, kind: str, **fields) -> None:
        """Best effort: a peer that is gone is the reader's to report."""
        line = (json.dumps({"kind": kind, **fields}) + "\n").encode()
        with self._send_lock:
            if self.closed:
                return
            try:
                self.sock.sendall(line)
            except OSError:
                pass

    def close(self) -> None:
        with self._send_lock:
            self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _read(self, reader) -> None:
        why = self._read_until_lost(reader)
        if why is None or self.closed:
            self._read_until_gone()
            return
        # The peer's end is watched on a thread of its own: _on_lost may wait for it (rank 0
        # under --supervise exits from here, after kill_stuck_ranks waits for ``gone``), and
        # on this thread nothing would set it: a rank that had failed and exited was waited
        # for a whole second, then sent a SIGKILL by a pid no longer its own.
        threading.Thread(target=self._read_until_gone, name=f"group-rank-{self.peer}-end", daemon=True).start()
        self._on_lost(self.peer, why)

    def _read_until_gone(self) -> None:
        """After its last word, the peer's process exits: its end closes (``gone``).
        A peer that stays silent instead is stopped or wedged. Read from the
        socket itself: its file object refuses every read after a timeout."""
        while not self.gone.is_set():
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                return
            except OSError:
                data = b""
            if not data:
                self.gone.set()

    def _read_until_lost(self, reader) -> Optional[str]:
        """Read lines until the peer is lost (why) or, rank 0, says the group stops (None)."""
        while True:
            try:
                line = reader.readline()
            except socket.timeout:
                return f"sent nothing for {self._peer_timeout_s:g} s (stopped or wedged)"
            except OSError as e:
                self.gone.set()
                return f"its connection failed ({type(e).__name__})"
            if not line:
                self.gone.set()
                return "closed its connection (the process is gone)"
            self.last_heard = time.monotonic()
            try:
                message = json.loads(line)
            except (ValueError, RecursionError):
                return "sent an unreadable line"
            if message.get("kind") == "failing":
                return f"failed: {message.get('reason')}"
            if message.get("kind") == "stopping":
                if self.peer == 0:
                    self._on_stopping(self.peer)
                    return None  # rank 0 stops the group: its end closing next is no loss
                if self.asked:
                    continue  # said again as it leaves, once rank 0 has said the group stops
                self.asked = True
                self._on_stopping(self.peer)
                # A rank that asks rank 0 to stop the group stays in it until rank 0 says
                # so: its failure or its loss meanwhile is the group's (rank 0's collectives
                # would wait for it), and was not heard, so clients waited for the stall limit
                # or the whole drain, and rank 0 exited 0.


class ControlLinks:
    """This rank's control connections: rank 0 holds one per other rank, the others one to rank 0."""

    def __init__(self, rank: int, size: int, *, beat_s: float, peer_timeout_s: float,
                 on_lost: OnLost, on_stopping: Callable[[int], None], join_timeout_s: float = JOIN_TIMEOUT_S):
        self.rank = rank
        self.size = size
        self.beat_s = beat_s
        self.peer_timeout_s = peer_timeout_s
        self.join_timeout_s = join_timeout_s
        self._on_lost = on_lost
        self._on_stopping = on_stopping
        self.connections: list[Connection] = []
        self._listener: Optional[socket.socket] = None
        # Rank 0's, shared with the other ranks by the rendezvous; each says it in its hello.
        self.token = secrets.token_hex(16) if rank == 0 else ""
        self._stopped = threading.Event()

    # -- rank 0 --------------------------------------------------------------
    def listen(self, host: str) -> tuple[str, int]:
        """Rank 0: listen on ``host`` (an ephemeral port); the address to share."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        # Room for the ranks beside whatever else connects while they join (a SYN dropped
        # from a full backlog is sent again a second later).
        self._listener.listen(max(self.size, MAX_PENDING_HELLOS))
        return host, self._listener.getsockname()[1]

    def accept_all(self) -> None:
        """Rank 0: take every other rank's connection, each saying which rank it is.

        Whoever reaches the listener (it is on the network) may write anything, or
        nothing and hold its connection: hellos are read side by side, each up to its
        line's end and no further (what follows is the connection's), and one that is
        none is refused without holding up the ranks that join."""
        deadline = time.monotonic() + self.join_timeout_s
        hellos: dict[socket.socket, bytes] = {}  # connected, their hello not yet whole
        self._listener.setblocking(False)
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self._listener, selectors.EVENT_READ)
                while len(self.connections) < self.size - 1:
                    if time.monotonic() >= deadline:  # checked each pass: a peer's trickle must not defer it
                        joined = sorted(c.peer for c in self.connections)
                        raise TimeoutError(f"ranks other than {[0, *joined]} did not connect "
                                           f"within {self.join_timeout_s:g} s (join_timeout_s)")
                    for key, _ in selector.select(deadline - time.monotonic()):
                        if key.fileobj is self._listener:
                            self._accept_one(selector, hellos)
                        elif key.fileobj in hellos:  # else let go earlier in this pass
                            self._take_hello(selector, hellos, key.fileobj)
        finally:
            for sock in hellos:
                sock.close()
            self._listener.close()

    def _accept_one(self, selector, hellos: dict) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # reset while queued (BSD, macOS: ECONNABORTED), out of descriptors
            log.warning("group_accept_failed", error_message=str(e))
            # One that lasts (EMFILE) leaves the listener readable: not a spin of warnings.
            time.sleep(ACCEPT_RETRY_S)
            return
        sock.setblocking(False)
        if len(hellos) >= MAX_PENDING_HELLOS:
            oldest = next(iter(hellos))
            selector.unregister(oldest)
            del hellos[oldest]
            oldest.close()
        hellos[sock] = b""
        selector.register(sock, selectors.EVENT_READ)

    def _take_hello(self, selector, hellos: dict, sock: socket.socket) -> None:
        """More of ``sock``'s hello; once it is whole, the rank it names joins, or it is refused."""
        line = self._read_hello_line(sock, hellos)
        if line is None:
            return  # not whole yet
        selector.unregister(sock)
        del hellos[sock]
        hello, why = self._judge_hello(line)
        if why is not None:
            log.warning("group_hello_refused", peer=peer_address(sock), reason=why)
            sock.close()
            return
        try:
            self._add(sock, hello["rank"], None, hello)
        except OSError as e:  # reset since its hello (macOS: EINVAL from setsockopt): it joins again or not at all
            log.warning("group_hello_refused", peer=peer_address(sock), reason=f"gone since its hello: {e}")
            sock.close()

    @staticmethod
    def _read_hello_line(sock: socket.socket, hellos: dict) -> Optional[bytes]:
        """More of ``sock``'s hello: the line once whole (or once it cannot be: too long,
        closed, failed), else None. Never reads past the line's end."""
        try:
            peeked = sock.recv(MAX_HELLO_BYTES, socket.MSG_PEEK)
            end = peeked.find(b"\n")
            taken = sock.recv(end + 1 if end >= 0 else len(peeked)) if peeked else b""
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return b""
        line = hellos[sock] + taken
        hellos[sock] = line
        if end >= 0 or not peeked or len(line) >= MAX_HELLO_BYTES:
            return line
        return None

    def _judge_hello(self, line: bytes) -> tuple[dict, Optional[str]]:
        """A joining rank's hello, or why ``line`` is none."""
        try:
            hello = json.loads(line)
        except (ValueError, RecursionError):  # nested past the parser's recursion: anyone may send it
            return {}, "not a hello (unreadable)"
        if not isinstance(hello, dict) or hello.get("kind") != "hello":
            return {}, "not a hello"
        token = hello.get("token")
        if not isinstance(token, str) or not token.isascii() or not hmac.compare_digest(
                token.encode(), self.token.encode()):  # (a lone surrogate does not encode)
            return {}, "not the group's token"
        rank = hello.get("rank")
        joined = {c.peer for c in self.connections}
        if type(rank) is not int or not 0 < rank < self.size or rank in joined:
            return {}, f"rank {rank!r} is none still to join"
        return hello, None

    # -- other ranks -------------------------------------------------------------
    def connect(self, address: tuple[str, int], token: str) -> None:
        """Any other rank: connect to rank 0 and say which rank this is, with the group's token."""
        sock = socket.create_connection(address, timeout=self.join_timeout_s)
        hello = {"kind": "hello", "rank": self.rank, "token": token, "pid": os.getpid(),
                 "host": socket.gethostname()}
        sock.sendall((json.dumps(hello) + "\n").encode())
        self._add(sock, 0)

    # -- both -----------------------------------------------------------------------
    def _add(self, sock: socket.socket, peer: int, reader=None, hello: Optional[dict] = None) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = Connection(sock, peer, self.peer_timeout_s, self._on_lost, self._on_stopping, hello)
        self.connections.append(connection)
        connection.start(reader)

    def start_beats(self) -> None:
        threading.Thread(target=self._beat, name="group-beat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stopped.wait(self.beat_s):
            for connection in self.connections:
                connection.send("beat")

    def tell(self, kind: str, **fields) -> None:
        """Tell every connected rank (``failing`` with a reason, or ``stopping``)."""
        for connection in self.connections:
            connection.send(kind, **fields)

    def stuck_local_peers(self, wait_s: float) -> list[Connection]:
        """Rank 0, as the group fails: the ranks on this machine whose process has
        not ended ``wait_s`` from now (each was told; a stopped or wedged one cannot
        act on it, and would keep its launcher waiting for ever)."""
        deadline = time.monotonic() + wait_s
        here = socket.gethostname()
        return [c for c in self.connections
                if c.peer_pid and c.peer_host == here
                and not c.gone.wait(max(0.0, deadline - time.monotonic()))]

    def status(self) -> list[dict]:
        """Each connected rank as this one sees it, for ``/guardian/status``."""
        now = time.monotonic()
        return [{"rank": c.peer, "pid": c.peer_pid, "host": c.peer_host,
                 "last_heard_s": round(now - c.last_heard, 3), "gone": c.gone.is_set()}
                for c in sorted(self.connections, key=lambda c: c.peer)]

    def close(self) -> None:
        self._stopped.set()
        for connection in self.connections:
            connection.close()


def peer_address(sock: socket.socket) -> str:
    """Who connected, as logged; "unknown" once it has gone."""
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "unknown"
