"""Loaded at start-up by the "handed-off" server ``bench/tagging_cost.py --hand-off`` starts
(on PYTHONPATH): with ``GUARDIAN_BENCH_SELF_HANDOFF`` set, the in-process server hands each
whole request to itself through ``guardian.handoff``, as a supervisor hands it to its child:
the journal, the descriptors over a channel, the tags and the journal records on every
streamed token, the child's word on the control pipe, its reading and the closes. So it pays
both sides' work for each request, in one process and with no supervisor. Nothing here runs
without that variable; the guardian's own code is not changed."""

import os

if os.environ.get("GUARDIAN_BENCH_SELF_HANDOFF"):
    from guardian import handoff
    from guardian.serving import connection

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
            connection.close_quietly(client)

        server.when_readable(handed.control, on_word)

    connection.HeldConnections.dispatch = _dispatch_to_self
