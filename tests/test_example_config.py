"""config/guardian.example.toml is written from the settings registry, byte for byte."""

from __future__ import annotations

from pathlib import Path

from guardian.config.reference import example_toml
from guardian.config.loading import load_config

EXAMPLE = Path(__file__).resolve().parent.parent / "config" / "guardian.example.toml"


def test_example_file_is_the_registry_written_out():
    # On failure: python -m guardian.config.reference > config/guardian.example.toml
    assert EXAMPLE.read_text() == example_toml(), (
        f"{EXAMPLE.name} is stale: python -m guardian.config.reference > config/guardian.example.toml"
    )


def test_example_file_reads_back_as_the_defaults():
    config = load_config(EXAMPLE)
    assert config.tables[:3] == ("guardian", "watchdog", "supervisor")
    assert config.core == type(config.core)() and config.supervisor == type(config.supervisor)()
    assert config.watchdog == type(config.watchdog)()


def test_every_declared_table_is_in_the_example():
    # A table declared in guardian/ whose module is not a built-in entry
    # point would check a file the example never shows.
    from guardian.plugin_manager import make_plugin_manager
    from guardian.config.registry import TABLES

    make_plugin_manager(load_config(None))  # imports every built-in plugin
    text = EXAMPLE.read_text()
    for name, table in TABLES.items():
        if table.in_toml and table.__module__.startswith("guardian."):
            assert f"\n[{name}]\n" in text, f"[{name}] is declared but not in {EXAMPLE.name}"
