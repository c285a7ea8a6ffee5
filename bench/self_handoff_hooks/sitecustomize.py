"""Loaded at start-up by the servers ``bench/tagging_cost.py --hand-off`` and ``--child-side``
start (on PYTHONPATH). Nothing here runs without one of the two variables below; the
guardian's own code is not changed.

``GUARDIAN_BENCH_SELF_HANDOFF``: the in-process server hands each whole request to itself
through ``guardian.handoff``, as a supervisor hands it to its child: the journal, the
descriptors over a channel, the tags and the journal records on every streamed token, the
child's word on the control pipe, its reading and the closes. So it pays both sides' work
for each request, in one process and with no supervisor.

``GUARDIAN_BENCH_CHILD_SIDE``: only what a child would do if it accepted its connections
itself and a supervisor cost nothing per request (the design in bench/README, "what 0.99
on the demo model would take"): the server writes the request into a journal of its own,
makes the control pipe, passes the client's socket, the journal and the pipe's reading end
in one message to a channel that is drained only every 64 requests (a supervisor reading
it lazily), and answers through ``handoff.Received``: tags, journal records, the word.
No head is parsed twice, nothing is received, nobody wakes for the word."""

import os

if os.environ.get("GUARDIAN_BENCH_SELF_HANDOFF"):
    from guardian import handoff
    from guardian.serving import connection, sockets

    _dispatch = connection.HeldConnections.dispatch
    _channels: dict = {}

    def _dispatch_to_self(server, incoming):
        if incoming.handed_off is not None or incoming.headers_end < 0:
            return _dispatch(server, incoming)  # the request handed over, or one the reader refuses
        channel = _channels.get(id(server))
        if channel is None:
            channel = _channels[id(server)] = handoff.Channel()
            server.take_handoffs(channel.child_end)
        client = incoming.sock
        handed = channel.hand(client, bytes(incoming.buffer))
        if handed is None:  # the kernel cannot count the client's bytes: served as it is
            return _dispatch(server, incoming)

        def on_word():  # as the supervisor's fast hand-off takes the child's DONE
            handed.wait()
            handed.close()
            sockets.close_quietly(client)

        server.when_readable(handed.control, on_word)

    connection.HeldConnections.dispatch = _dispatch_to_self

elif os.environ.get("GUARDIAN_BENCH_CHILD_SIDE"):
    import itertools
    import socket

    from guardian import handoff
    from guardian.serving import connection, sockets

    _dispatch = connection.HeldConnections.dispatch
    _to_supervisor, _supervisor_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    _supervisor_end.setblocking(False)
    _DRAIN_EVERY = 64
    _handed = itertools.count(1)  # dispatch runs on the reader's thread alone

    def _drain() -> None:
        """The lazy supervisor: take every message waiting and close what it carried (a
        descriptor in flight keeps its file open, so nothing closed early)."""
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(_supervisor_end, _DRAIN_EVERY, 3 * _DRAIN_EVERY)
            except BlockingIOError:
                return
            for fd in fds:
                os.close(fd)

    def _dispatch_as_child(server, incoming):
        if incoming.handed_off is not None or incoming.headers_end < 0:
            return _dispatch(server, incoming)
        journal, _ = handoff.new_journal(bytes(incoming.buffer))
        control, child_control = os.pipe()
        socket.send_fds(_to_supervisor, [b"h"], [incoming.sock.fileno(), journal, control])
        os.close(control)
        incoming.handed_off = handoff.Received(incoming.sock, journal, child_control)
        if next(_handed) % _DRAIN_EVERY == 0:
            _drain()
        return _dispatch(server, incoming)

    connection.HeldConnections.dispatch = _dispatch_as_child
