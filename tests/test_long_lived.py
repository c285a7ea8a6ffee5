"""What lives as long as the process is frozen out of the collector's walks
(guardian.long_lived), in a served model's process and in the supervisor."""

from __future__ import annotations

import gc

from guardian import long_lived


def walked(obj) -> bool:
    """Whether a full collection walks ``obj`` (it is in one of the collected generations)."""
    return any(tracked is obj for tracked in gc.get_objects())


def test_freeze_leaves_what_exists_out_of_a_full_collection_and_thaw_lets_it_back():
    keep = [[i] for i in range(1000)]  # long-lived objects, as a loaded model's are
    assert walked(keep)
    try:
        frozen = long_lived.freeze()
        assert frozen == gc.get_freeze_count() > len(keep)
        assert not walked(keep) and not walked(keep[0])
        made_later = [[0]]
        assert walked(made_later)  # what comes after is collected as before
    finally:
        long_lived.thaw()
    assert gc.get_freeze_count() == 0 and walked(keep)


def test_a_served_model_freezes_its_start_up_objects(start_server):
    server = start_server("")
    [started] = server.events("server_started")
    # The model's modules and weights, every imported module: tens of thousands.
    assert started["frozen_objects"] > 20_000, started
