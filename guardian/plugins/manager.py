"""Builds the plugin manager: specs, entry points, config, built-ins.

Built-in behaviour is plugins registered exactly like third-party ones.
A plugin is a module, or a class that takes its settings: a class with a
``Settings`` dataclass gets the TOML table named after its ``name``.
"""

from __future__ import annotations

import importlib
import importlib.metadata

import pluggy
import structlog

from guardian.plugins import hookspecs
from guardian.config import ConfigError, GuardianConfig, parse_settings

log = structlog.get_logger("guardian.plugins")

DEFAULT_PLUGINS = (
    "guardian.plugins.recovery:Recovery",
    "guardian.plugins.fault_injection:FaultInjection",
    "guardian.plugins.prompt_guard:PromptGuard",
    "guardian.plugins.generation_probe:GenerationProbe",
    "guardian.plugins.resources:Resources",
)


def make_plugin_manager(config: GuardianConfig) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    tables = dict(config.plugin_tables)
    for entry_point in importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME):
        register(pm, entry_point.load(), tables, entry_point.name)
    for spec in config.core.plugins:
        register(pm, resolve(spec), tables, spec)
    for spec in DEFAULT_PLUGINS:
        plugin = resolve(spec)
        if plugin.name not in config.core.disabled_plugins:
            register(pm, plugin, tables, spec)
    if tables:
        names = ", ".join(f"[{name}]" for name in tables)
        raise ConfigError(f"{config.source}: no loaded plugin reads {names}")
    pm.check_pending()
    return pm


def resolve(spec: str):
    """Import ``package.module`` or ``package.module:attribute``."""
    module_name, _, attribute = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
        return getattr(obj, attribute) if attribute else obj
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load plugin {spec!r}: {e}") from None


def register(pm: pluggy.PluginManager, plugin, tables: dict, spec: str) -> None:
    name = getattr(plugin, "name", None) or getattr(plugin, "__name__", spec)
    if isinstance(plugin, type):
        settings_class = getattr(plugin, "Settings", None)
        table = tables.pop(name, {})
        if settings_class is not None:
            plugin = plugin(parse_settings(settings_class, table, name))
        elif table:
            raise ConfigError(f"[{name}]: plugin {spec!r} takes no settings")
        else:
            plugin = plugin()
    pm.register(plugin, name=name)


def active_hook(pm: pluggy.PluginManager, name: str):
    """The hook caller for ``name`` without the plugins that say ``active = False``;
    None when no implementation is left, so a hot path can skip the call."""
    inactive = [p for p in pm.get_plugins() if getattr(p, "active", True) is False]
    caller = pm.subset_hook_caller(name, remove_plugins=inactive)
    return caller if caller.get_hookimpls() else None


def notify(hook, **kwargs) -> None:
    """Call an observer hook; a plugin's exception is logged, not raised."""
    try:
        hook(**kwargs)
    except Exception:
        log.exception("plugin_hook_failed", hook=hook.name)


def describe(pm: pluggy.PluginManager) -> list[dict]:
    """What the ``plugins`` command prints: each plugin and its hooks."""
    described = []
    for name, plugin in sorted(pm.list_name_plugin()):
        hooks = sorted(caller.name for caller in pm.get_hookcallers(plugin) or [])
        described.append({"name": name, "hooks": hooks})
    return described
