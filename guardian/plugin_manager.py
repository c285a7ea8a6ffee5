"""Builds the plugin manager: specs, entry points, config, built-ins.

Built-in behaviour is plugins registered exactly like third-party ones:
entry points in the ``mlx_guardian`` group (pyproject.toml).
A plugin is a module, or a class that takes its settings: a class with a
``Settings`` dataclass gets the TOML table named after its ``name``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Callable, Iterator, Optional

import pluggy
import structlog

from guardian import hookspecs
from guardian.config.registry import TABLES, ConfigError, unread_tables
from guardian.config.loading import GuardianConfig, parse_settings

log = structlog.get_logger("guardian.plugins")

# Our own distribution: its entry points are the built-in plugins.
DISTRIBUTION = "mlx-guardian"

# Hooks the core cannot run without: no implementation at start is a
# configuration error, not a surprise at the first failure.
REQUIRED_HOOKS = {
    "on_engine_error": "decides what follows an engine failure (the built-in: recovery)",
    "probe": "proves that generation works (the built-in: generation_probe)",
    # Without one, every request was let in, keys and protected mode notwithstanding,
    # while the start line still named the door's mode.
    "check_access": "lets a request in or refuses it at the door (the built-in: access)",
}


def make_plugin_manager(config: GuardianConfig, live=None) -> pluggy.PluginManager:
    """Specs, then plugins: third-party entry points, ``[guardian] plugins``, built-ins.

    Built-ins register last, so among hooks without tryfirst/trylast they
    are called first (pluggy calls the newest first), as before they were
    entry points; their fallbacks are marked trylast. Each plugin's parsed
    settings go into ``config.plugin_settings``; with ``live`` (a
    guardian.config.live.LiveConfig over ``config``) a plugin gets a view
    that reads the version of its table in force at each use.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    disabled = set(config.core.disabled_plugins)
    # A disabled plugin's table stays in the file, unread: turned off for a while, kept as it was.
    tables = {name: table for name, table in config.plugin_tables.items() if name not in disabled}
    third_party, built_in = plugin_entry_points()
    if not built_in:
        raise ConfigError(
            f"no {hookspecs.PROJECT_NAME} entry points of {DISTRIBUTION} are installed: "
            "install the package (pip install -e .) so its built-in plugins register"
        )
    found = {entry_point.name for entry_point in (*third_party, *built_in)}  # and each plugin's own name
    loading = dict(tables=tables, disabled=disabled, config=config, live=live)
    for entry_point in third_party:
        if entry_point.name not in disabled:
            found.add(register(pm, load(entry_point), spec=entry_point.value, **loading))
    for spec in config.core.plugins:
        found.add(register(pm, resolve(spec), spec=spec, **loading))
    for entry_point in built_in:
        if entry_point.name not in disabled:
            found.add(register(pm, load(entry_point), spec=entry_point.value, **loading))
    unknown = sorted(disabled - found)
    if unknown:  # a misspelt name left its plugin on, where every other typo stops the start
        raise ConfigError(f"[guardian] disabled_plugins: no plugin is named {', '.join(map(repr, unknown))}; "
                          f"those found: {', '.join(sorted(found))}")
    if tables:
        raise unread_tables(config.source, tables, {*found, *TABLES})
    check_required_hooks(pm)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:  # a hook name no spec has (a misspelt one)
        raise ConfigError(f"plugin {pm.get_name(e.plugin) or plugin_spec(e.plugin)!r} "
                          f"({plugin_spec(e.plugin)}): {e}") from None
    return pm


def check_plugin_list(config: GuardianConfig) -> None:
    """Load ``config``'s plugins as a start would, and drop them: ConfigError where a start
    could not (a live save's new plugin list, guardian.config.live). Plugins' ``__init__``
    runs; their start-up hooks do not."""
    make_plugin_manager(config)


def plugin_entry_points() -> tuple[list, list]:
    """The ``mlx_guardian`` entry points: (third-party, ours), each once.

    An editable install can list a distribution twice; the same name and
    target seen again is the same plugin.
    """
    third_party, built_in, seen = [], [], set()
    for entry_point in importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME):
        if (entry_point.name, entry_point.value) in seen:
            continue
        seen.add((entry_point.name, entry_point.value))
        dist = getattr(entry_point, "dist", None)
        ours = dist is not None and dist.metadata["Name"] == DISTRIBUTION
        (built_in if ours else third_party).append(entry_point)
    return third_party, built_in


def load(entry_point):
    try:
        return entry_point.load()
    except Exception as e:
        raise ConfigError(f"cannot load plugin {entry_point.name!r} ({entry_point.value}): {e}") from None


def check_required_hooks(pm: pluggy.PluginManager) -> None:
    for name, why in REQUIRED_HOOKS.items():
        if not getattr(pm.hook, name).get_hookimpls():
            raise ConfigError(
                f"no plugin implements {name}, which {why}; "
                "remove it from [guardian] disabled_plugins or add a plugin that implements it"
            )


def resolve(spec: str):
    """Import ``package.module`` or ``package.module:attribute``."""
    module_name, _, attribute = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
        return getattr(obj, attribute) if attribute else obj
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load plugin {spec!r}: {e}") from None
    except Exception as e:  # its module raised as it was imported (a SyntaxError, its own check)
        raise ConfigError(f"cannot load plugin {spec!r}: {type(e).__name__}: {e}") from None


def register(pm: pluggy.PluginManager, plugin, tables: dict, spec: str, disabled=frozenset(), *,
             config=None, live=None) -> str:
    """Make ``plugin`` (with its table's settings) and register it, unless its name is
    ``disabled``; its name."""
    name = plugin_name(plugin, spec)
    if name in disabled:
        return name
    if pm.has_plugin(name):
        raise ConfigError(
            f"two plugins are named {name!r}: {spec!r} and {plugin_spec(pm.get_plugin(name))!r}; "
            "leave one out: an installed one by its entry point's name in [guardian] disabled_plugins "
            "(the name before '=' in its distribution's mlx_guardian entry points; the name they "
            "share leaves out both), one of [guardian] plugins by taking it off that list"
        )
    try:
        if isinstance(plugin, type):
            settings_class = getattr(plugin, "Settings", None)
            table = tables.pop(name, {})
            if settings_class is not None:
                settings = parse_settings(settings_class, table, name)
                if config is not None:
                    config.plugin_settings[name] = settings
                plugin = plugin(live.view(name) if live is not None else settings)
            elif table:
                raise ConfigError(f"[{name}]: plugin {spec!r} takes no settings")
            else:
                plugin = plugin()
        pm.register(plugin, name=name)
        refuse_wrappers(pm, plugin, name)
    except ConfigError:
        raise
    except Exception as e:
        # Its __init__ or settings raised, or pluggy refused a hook (a misspelt name): a
        # configuration that can never start (exit 2), not a crash to retry (exit 1, which
        # a supervisor took for a crash loop).
        raise ConfigError(f"cannot load plugin {spec!r}: {type(e).__name__}: {e}") from None
    return name


def refuse_wrappers(pm: pluggy.PluginManager, plugin, name: str) -> None:
    """A hook wrapper (``wrapper=True``, ``hookwrapper=True``) is refused: the guardian calls
    each plugin's implementation on its own, so that one plugin's failure is contained, and a
    wrapper would need pluggy's own call of them all (one wrapper turned that off for every
    plugin of its hook: the built-in memory thresholds' sample went unmade)."""
    for caller in pm.get_hookcallers(plugin) or []:
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and (impl.hookwrapper or impl.wrapper):
                pm.unregister(plugin)
                raise ConfigError(f"plugin {name!r}: its {caller.name} is a hook wrapper; mlx-guardian calls "
                                  "each implementation on its own and takes no wrappers (implement the hook)")


def plugin_name(plugin, spec: str) -> str:
    return getattr(plugin, "name", None) or getattr(plugin, "__name__", spec)


def plugin_spec(plugin) -> str:
    """Where a registered plugin comes from, for messages."""
    cls = plugin if isinstance(plugin, type) or hasattr(plugin, "__file__") else type(plugin)
    return f"{cls.__module__}:{cls.__qualname__}" if isinstance(cls, type) else cls.__name__


def active_hook(pm: pluggy.PluginManager, name: str):
    """The hook caller for ``name`` without the plugins that say ``active = False``;
    None when no implementation is left, so a hot path can skip the call."""
    inactive = [p for p in pm.get_plugins() if getattr(p, "active", True) is False]
    caller = pm.subset_hook_caller(name, remove_plugins=inactive)
    return caller if caller.get_hookimpls() else None


def notify(hook, **kwargs) -> None:
    """Call an observer hook, each plugin's implementation on its own and in pluggy's
    order: one that raises is logged (with its plugin's name) and those after it are
    still called. (pluggy stops a call at its first exception: one plugin's bug
    silenced the notifier's alerts, and the access plugin's token charge.)"""
    for plugin, _result, error in call_each(hook, **kwargs):
        if error is not None:
            log.error("plugin_hook_failed", hook=hook.name, plugin=plugin, exc_info=error)


def first_answer(hook, valid: Callable[[object], bool], **kwargs):
    """A first-result hook's answer, each implementation called on its own, in pluggy's
    order: one that raises, or answers what ``valid`` refuses, is logged with its plugin's
    name and passed over as having no opinion (a plugin's typo, ``"restart "``, ended the
    process with exit 4 at the first engine failure). None: no valid answer."""
    for plugin, result, error in call_each(hook, **kwargs):
        if error is not None:
            log.error("plugin_hook_failed", hook=hook.name, plugin=plugin, exc_info=error)
        elif result is not None:
            if valid(result):
                return result
            log.error("plugin_hook_answer_invalid", hook=hook.name, plugin=plugin, answer=repr(result)[:200])
    return None


def call_each(hook, **kwargs) -> Iterator[tuple[str, object, Optional[Exception]]]:
    """(plugin name, result, exception) of each implementation of ``hook`` (none is a
    wrapper: ``refuse_wrappers``), each called on its own, in pluggy's order: the last registered, and
    tryfirst, first. Its arguments as pluggy's own call gives them (``_multicall``): the
    ones it names, by position, from ``HookImpl``'s public ``argnames``; pluggy has no
    public call of one implementation."""
    for plugin, call in implementations(hook):
        try:
            result = call(**kwargs)
        except Exception as e:
            yield plugin, None, e
        else:
            yield plugin, result, None


def implementations(hook) -> list[tuple[str, Callable[..., object]]]:
    """(plugin name, ``call(**kwargs)``) of each implementation of ``hook``, in
    ``call_each``'s order, for a caller that runs each its own way (on a thread of its own:
    ``guardian.health.plugin_probes``)."""
    def caller(impl):
        return lambda **kwargs: impl.function(*[kwargs[name] for name in impl.argnames])
    return [(impl.plugin_name, caller(impl)) for impl in reversed(hook.get_hookimpls())]


def describe(pm: pluggy.PluginManager) -> list[dict]:
    """What the ``plugins`` command prints: each plugin and its hooks."""
    described = []
    for name, plugin in sorted(pm.list_name_plugin()):
        hooks = sorted(caller.name for caller in pm.get_hookcallers(plugin) or [])
        described.append({"name": name, "hooks": hooks})
    return described
