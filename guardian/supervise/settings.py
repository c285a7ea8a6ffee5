"""What the supervisor reads: its own flags (every other flag goes to the child), and
of ``--guardian-config`` the tables it acts on, at start and at each save: [supervisor],
[access] and [http] (its public port's door and connection layer), a few of [guardian]'s,
[watchdog] probe_timeout_s (how long a deep readiness check may take) and [prompt_guard]
max_body_bytes (the longest body a child reads). Imports neither mlx nor mlx_lm.
"""

from __future__ import annotations

import argparse
from typing import Optional

from guardian.access import make_door
from guardian.config.loading import GuardianConfig, load_config
from guardian.config.registry import ConfigError
from guardian.config.tables import AccessSettings, CommandLine, CoreSettings, HttpSettings, SupervisorSettings
from guardian.observability.versions import version_line
from guardian.admission.guard_settings import PromptGuardSettings
from guardian.relay_protocol import HEADERS_ADDED_FOR_CHILD
from guardian.serving import framing
from guardian.serving.limits import HANDLER_HEADROOM, ConnectionLimits

# Stock's defaults for the public address, so --supervise changes nothing there.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


# Of the [guardian] table, the live settings the supervisor acts on too: its own 503s'
# Retry-After, the deadline of a request it holds (guardian.serving.deadlines), how
# long requests in flight get to reach their clients when it exits, and how often a
# cut stream waiting for the next child gets a keepalive comment.
SUPERVISOR_CORE_SETTINGS = ("retry_after_s", "request_timeout_s", "exit_grace_s", "stream_keepalive_s", "log_level")
# Of those, what a supervisor of a stock child never uses: a stock child's cut stream ends.
NOT_FOR_A_STOCK_CHILD = ("stream_keepalive_s",)


def public_door(options: argparse.Namespace, child_args: list[str]):
    """The public port's door: [access] from --guardian-config, the key-file flag
    winning, and the child's --allowed-origins (read here, passed on: the child's
    CORS headers grant what this door lets in)."""
    access = load_config(options.guardian_config).access.with_flags(options)
    origins = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    origins.add_argument("--allowed-origins", type=lambda x: x.split(","), default=None)
    allowed_origins = origins.parse_known_args(child_args)[0].allowed_origins
    return make_door(access, bound_host=options.host, allowed_origins=allowed_origins)


def public_limits(options: argparse.Namespace, child_args: list[str], settings: SupervisorSettings,
                  core: Optional[CoreSettings] = None, http: Optional[HttpSettings] = None):
    """The public port's connection layer: [http] (``http``, else from --guardian-config); its
    handler threads, when not set, sized from the child's --decode-concurrency and the
    requests the supervisor holds while no child is ready."""
    http = http or load_config(options.guardian_config).http.with_flags(options)
    flags = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    flags.add_argument("--decode-concurrency", type=int, default=32)  # stock's default
    decode_concurrency = flags.parse_known_args(child_args)[0].decode_concurrency
    auto = decode_concurrency + settings.hold_requests + HANDLER_HEADROOM
    # A head the child could not read whole is refused here, in OpenAI's shape.
    max_header_count = min(http.max_header_count, framing.STDLIB_MAX_HEADERS - HEADERS_ADDED_FOR_CHILD)
    return ConnectionLimits(**{**vars(http), "max_handlers": http.max_handlers or auto,
                               "max_header_count": max_header_count,
                               # A busy door's Retry-After, as the child's: [guardian] retry_after_s.
                               "retry_after_s": (core or CoreSettings()).retry_after_s})


def read_file(options: argparse.Namespace, still: bool = False) -> GuardianConfig:
    """--guardian-config as the supervisor reads it: each flag given winning over its key.
    ``still``: read again while it runs (guardian.config.loading.read_still)."""
    config = load_config(options.guardian_config, still=still)
    for attribute in ("core", "access", "http", "supervisor"):
        setattr(config, attribute, getattr(config, attribute).with_flags(options))
    return config


def acted_on_here(key: str) -> bool:
    """Whether the supervisor acts on setting ``key`` ("table.name") of the file; a guardian
    child reads the rest (and says which of those wait for a restart)."""
    table, _, name = key.partition(".")
    return (table in (AccessSettings.table_name, HttpSettings.table_name, SupervisorSettings.table_name)
            or (table == CoreSettings.table_name and name in SUPERVISOR_CORE_SETTINGS)
            or key == "watchdog.probe_timeout_s")


def child_body_limit(config: GuardianConfig, engine: str) -> Optional[int]:
    """The longest body a guardian child reads: [prompt_guard] max_body_bytes, live there,
    so read at every save here too. The public port answers a longer one 413 from its
    head, as the child would, rather than wait for a body the child then refuses whole.
    None: no limit (stock's engine, the guard left out or off, a table the child refuses)."""
    if engine != "guardian" or PromptGuardSettings.table_name in config.core.disabled_plugins:
        return None
    try:
        guard = PromptGuardSettings.from_toml(config.plugin_tables.get(PromptGuardSettings.table_name, {}))
    except ConfigError:
        return None
    return (guard.max_body_bytes or None) if guard.enabled else None


# -- command line ------------------------------------------------------------------
def make_parser() -> argparse.ArgumentParser:
    """Only the supervisor's flags, from the settings registry; every other flag goes to the child."""
    parser = argparse.ArgumentParser(
        prog="mlx-guardian --supervise",
        # Exact names only: a prefix of a child's flag must reach the child.
        allow_abbrev=False,
        description="Run the engine as a child process on a private port, relay "
                    "requests to it, and replace it when it dies or stops answering. "
                    "--engine and each --supervisor-* flag have a key in the [supervisor] "
                    "table of --guardian-config; a flag wins over the file.",
        epilog="Every other flag is passed to the child: mlx-guardian's and mlx_lm.server's "
               "(see `mlx-guardian --help`), or with --engine stock, mlx_lm.server's.",
    )
    CommandLine.add_flags(parser)
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print the versions of mlx-guardian, mlx-lm, mlx and Python, and exit")
    # Stock's flags and defaults for the public address, so --supervise changes nothing there.
    parser.add_argument("--host", default=DEFAULT_HOST, help="public host (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="public port (default: %(default)s)")
    SupervisorSettings.add_flags(parser)
    # The door is the public port's: the key file stays with the supervisor.
    AccessSettings.api_key_file.add_flag(parser)
    # The public port terminates TLS; the child stays plain HTTP on loopback.
    AccessSettings.ssl_certfile.add_flag(parser)
    AccessSettings.ssl_keyfile.add_flag(parser)
    # Read here and passed on: the supervisor logs the way the child does.
    CoreSettings.log_format.add_flag(parser)
    parser.add_argument("--log-level", default=None, help=argparse.SUPPRESS)
    return parser


# Flags of the child's that the supervisor reads from the child's arguments too.
CHILD_FLAGS_READ_HERE = ("--allowed-origins", "--decode-concurrency")


def abbreviated_flag(parser: argparse.ArgumentParser, child_args: list[str]) -> Optional[str]:
    """A refusal if ``child_args`` hold a shortened flag that the child's parser (stock's,
    which takes any unambiguous prefix) would read as one the supervisor reads: it would
    not, and the child would act on it alone (``--api-key FILE`` reaching the child as
    ``--api-key-file``, which a child ignores: the public port served with no key).
    None when there is none. No flag of the child's is such a prefix
    (tests/test_supervisor.py checks it)."""
    read_here = [*parser._option_string_actions, *CHILD_FLAGS_READ_HERE]  # noqa: SLF001 - argparse's own table
    for arg in child_args:
        if arg == "--":
            break
        name = arg.partition("=")[0]
        if not name.startswith("--") or name in read_here:
            continue
        meant = sorted(flag for flag in read_here if flag.startswith(name) and flag.startswith("--"))
        if meant:
            return (f"{name} is short for {' or '.join(meant)}, which the supervisor reads: "
                    f"under --supervise, spell it in full")
    return None


def read_settings(options: argparse.Namespace) -> tuple[SupervisorSettings, CoreSettings]:
    """[supervisor] and [guardian] from --guardian-config, each flag given winning over the file.

    A guardian child reads the same file and checks the rest of it; stock
    reads none of it, so with --engine stock any other table is an error.
    """
    config = read_file(options)
    check_stock_tables(config, config.supervisor.engine)
    return config.supervisor, config.core


# [access] settings a guardian engine applies itself (the access plugin, the ledger), not the door.
ENGINE_ADMISSION_SETTINGS = ("client_max_concurrent", "client_tokens_per_minute", "fair_admission",
                             "fair_admission_recent_s")


def check_stock_tables(config, engine: str) -> None:
    """With --engine stock the file may hold only what the supervisor reads: ConfigError if not
    (at start, and at each save: a version a restart would refuse is refused live too)."""
    if engine != "stock":
        return
    # [access] and [http] are the public port's, which the supervisor serves whatever the child;
    # of [guardian], what the supervisor acts on itself (deadlines, Retry-After, the drain, its log).
    core_read = (*(name for name in SUPERVISOR_CORE_SETTINGS if name not in NOT_FOR_A_STOCK_CHILD), "log_format")
    others = [name for name in config.tables
              if name not in (SupervisorSettings.table_name, AccessSettings.table_name, HttpSettings.table_name,
                              CoreSettings.table_name)]
    if others:
        raise ConfigError(f"{config.source}: --engine stock reads only [supervisor], [access], [http] and, of "
                          f"[guardian], {', '.join(core_read)}; nothing reads [{others[0]}]")
    unread = [key for key in config.core_keys.get(CoreSettings.table_name, ()) if key not in core_read]
    if unread:
        raise ConfigError(f"{config.source}: --engine stock reads only [supervisor], [access], [http] and, of "
                          f"[guardian], {', '.join(core_read)}; nothing reads [guardian] {unread[0]}")
    # Per-client limits are a guardian engine's, applied as it admits a request: stock admits
    # every one. Accepted, a limit a user set was silently never applied (a review).
    defaults = AccessSettings()
    limits = [key for key in config.core_keys.get(AccessSettings.table_name, ())
              if key in ENGINE_ADMISSION_SETTINGS and getattr(config.access, key) != getattr(defaults, key)]
    if limits:
        raise ConfigError(f"{config.source}: [access] {limits[0]} is applied by a guardian engine as it admits "
                          f"a request; --engine stock admits every request and would never apply it")
