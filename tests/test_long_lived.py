"""What lives as long as the process is frozen out of the collector's walks
(guardian.long_lived). That a served model's process and the supervisor
freeze theirs: test_logs.py and test_protected_mode.py read it from their
start-up lines."""

from __future__ import annotations

import gc
import sys

from guardian import long_lived


def walked(obj) -> bool:
    """Whether a full collection walks ``obj`` (it is in one of the collected generations)."""
    return any(tracked is obj for tracked in gc.get_objects())


def test_freeze_leaves_what_exists_out_of_a_full_collection_and_thaw_lets_it_back():
    keep = [[i] for i in range(1000)]  # long-lived objects, as a loaded model's are
    assert walked(keep)
    switch_interval = sys.getswitchinterval()
    # No other thread of this process runs between the freeze and the count: under
    # pytest-xdist, its channel's thread freed frozen objects meanwhile (231,260 frozen,
    # 231,254 counted).
    sys.setswitchinterval(60.0)
    try:
        try:
            frozen, count = long_lived.freeze(), gc.get_freeze_count()
        finally:
            sys.setswitchinterval(switch_interval)
        assert frozen == count > len(keep)
        assert not walked(keep) and not walked(keep[0])
        made_later = [[0]]
        assert walked(made_later)  # what comes after is collected as before
    finally:
        long_lived.thaw()
    assert gc.get_freeze_count() == 0 and walked(keep)



def test_every_load_that_drops_the_model_thaws_first(monkeypatch):
    """Only a failure's reload thawed: the ladder's reload and a switch to another model
    dropped the frozen model without, and a cycle in it stayed for the life of the process."""
    from types import SimpleNamespace

    from guardian.stock import models

    monkeypatch.setattr(models, "_drop_loaded_model", lambda provider: None)
    monkeypatch.setattr(models.ModelProvider, "_load", lambda provider, *key: None)
    provider = SimpleNamespace()
    models.guard_model_loads(provider, check_owner=lambda: None)
    try:
        long_lived.freeze()
        assert gc.get_freeze_count() > 0
        provider._load("another-model", None, None)
        assert gc.get_freeze_count() == 0
    finally:
        long_lived.thaw()
