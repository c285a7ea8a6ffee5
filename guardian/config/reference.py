"""config/guardian.example.toml, written from the declarations:

    python -m guardian.config.reference > config/guardian.example.toml

tests/test_example_config.py checks it; tools/docs_reference.py writes the settings page from the
same registry.
"""

from __future__ import annotations

import inspect

from guardian.config.registry import Table
from guardian.config.tables import CORE_TABLES


# -- the example file ------------------------------------------------------------------
EXAMPLE_HEADER = """\
# mlx-guardian configuration, passed with --guardian-config FILE.
#
# Every key is shown with its default. A key that is not listed here, or a
# value of the wrong type, stops the server at start with a message that
# names the key. [guardian], [watchdog], [supervisor], [access] and [http]
# configure the core; every other table belongs to the plugin of that name,
# and a table for a plugin that is not loaded is an error too.
#
# The server watches this file (and re-reads it on SIGHUP): keys marked
# "# live" take effect when it is saved, between requests; a change to any
# other key is logged (config_change_needs_restart) and waits for a restart.
# A saved file that does not parse or validate changes nothing
# (config_reload_failed); /guardian/status shows which version is live.
#
# Written from the settings each table declares (guardian/config/tables.py and
# each built-in plugin's beside its code, [prompt_guard] in
# guardian/admission/guard_settings.py); tests/test_example_config.py checks it. After
# changing a setting, regenerate it:
#   python -m guardian.config.reference > config/guardian.example.toml
"""


def example_toml() -> str:
    """config/guardian.example.toml: the core's tables, then each built-in plugin's."""
    tables = [*CORE_TABLES, *built_in_plugin_tables()]
    return EXAMPLE_HEADER + "".join("\n" + render_table(table) for table in tables)


def built_in_plugin_tables() -> list:
    """The settings tables of our own entry points (the built-in plugins), by name."""
    import importlib.metadata

    from guardian.hookspecs import PROJECT_NAME

    found = {}
    for entry_point in importlib.metadata.entry_points(group=PROJECT_NAME):
        dist = getattr(entry_point, "dist", None)
        if dist is not None and dist.metadata["Name"] == "mlx-guardian":
            settings = getattr(entry_point.load(), "Settings", None)
            if isinstance(settings, type) and issubclass(settings, Table):
                found[settings.table_name] = settings
    return [found[name] for name in sorted(found)]


def render_table(table: type[Table]) -> str:
    """One table of the example: its comment, then each key's comment and default."""
    lines = [f"[{table.table_name}]", *comment(table.__dict__.get("__doc__") or "")]
    first = next(iter(table.settings.values()), None)
    if len(lines) > 1 and first is not None and first.doc:
        lines.append("#")
    for setting in table.settings.values():
        doc = setting.doc
        if setting.flag:
            doc += f"\nThe {setting.flag} flag wins over this."
        lines += comment(doc)
        live = "  # live" if setting.live else ""
        lines.append(f"{setting.name} = {setting.type.toml(setting.default)}{live}")
    return "\n".join(lines) + "\n"


def comment(text: str) -> list[str]:
    """Text as TOML comment lines."""
    return [f"# {line}".rstrip() for line in inspect.cleandoc(text).splitlines()] if text else []


if __name__ == "__main__":
    print(example_toml(), end="")
