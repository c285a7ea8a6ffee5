"""config/guardian.example.toml is written from the settings registry, byte for byte."""

from __future__ import annotations

from pathlib import Path

from guardian.config import example_toml, load_config

EXAMPLE = Path(__file__).resolve().parent.parent / "config" / "guardian.example.toml"


def test_example_file_is_the_registry_written_out():
    # On failure: python -m guardian.settings > config/guardian.example.toml
    assert EXAMPLE.read_text() == example_toml(), (
        f"{EXAMPLE.name} is stale: python -m guardian.settings > config/guardian.example.toml"
    )


def test_example_file_reads_back_as_the_defaults():
    config = load_config(EXAMPLE)
    assert config.tables[:3] == ("guardian", "watchdog", "supervisor")
    assert config.core == type(config.core)() and config.supervisor == type(config.supervisor)()
    assert config.watchdog == type(config.watchdog)()
