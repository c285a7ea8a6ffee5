"""The ``mlx-guardian`` command: every mlx_lm.server flag, plus the guardian's.

``mlx-guardian [mlx_lm.server flags] [--guardian-config FILE] [--log-format
json|console]`` serves (the guardian's flags come from the settings
registry, ``guardian.config``); ``mlx-guardian --supervise ...`` runs it as a
supervised child process; ``mlx-guardian demo-model PATH`` writes the demo
model; ``mlx-guardian plugins`` lists plugins and their hooks; ``mlx-guardian
check-config FILE`` checks a configuration file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import textwrap
from pathlib import Path

import structlog

from guardian.config.tables import AccessSettings, CommandLine, CoreSettings, SupervisorSettings
from guardian.config.registry import ConfigError
from guardian.config import in_force
from guardian.config.loading import load_config
from guardian.exit_codes import EXIT_BOOT_ERROR, EXIT_UNCAUGHT, EXIT_USAGE, leave_for_supervisor
from guardian.access.keys import KeyRing
from guardian.access.policy import Origins
from guardian.observability.logs import bind_process, configure_logging, keep_stock_request_lines
from guardian.observability.versions import version_line
from guardian.health.parent_watch import leave_with_launcher_before_serving, leave_with_supervisor_before_serving
from guardian.relay_protocol import started_by_supervisor
from guardian.serving.open_files import raise_open_files_limit

log = structlog.get_logger("guardian.cli")


DESCRIPTION = """\
mlx_lm.server that survives a dying or stuck engine: every mlx_lm.server
flag below, and the guardian's (group "mlx-guardian")."""


def add_guardian_arguments(parser: argparse.ArgumentParser) -> None:
    """The guardian's flags beside stock's, from the settings registry; the
    other ways to run the command in the help's epilog."""
    stock_flags = [flag for flag in parser._option_string_actions if flag.startswith("--")]  # noqa: SLF001
    group = parser.add_argument_group("mlx-guardian")
    try:
        group.add_argument("--version", action="version", version=version_line(),
                           help="print the versions of mlx-guardian, mlx-lm, mlx and Python, and exit")
    except argparse.ArgumentError:
        pass  # a stock that has a --version of its own keeps it
    try:
        CommandLine.add_flags(group)
        CoreSettings.log_format.add_flag(group)
        AccessSettings.add_flags(group)
    except argparse.ArgumentError as e:
        # A stock release that added a flag of one of our names: said plainly, not argparse's
        # traceback at every start.
        parser.exit(2, f"mlx-guardian: this mlx-lm's server has a flag of the guardian's own: {e}. "
                       "Install an mlx-lm this mlx-guardian supports (its pyproject.toml says which), "
                       "or a newer mlx-guardian.\n")
    # None unless given: the door then grants only pages and apps on this machine
    # (stock's default, "*", let any web page drive the server). Its help says so.
    parser.set_defaults(allowed_origins=None)
    for action in parser._actions:  # noqa: SLF001 - argparse keeps no public list of them
        if action.dest == "allowed_origins":
            action.help = (f"Origins whose web pages may use the server (CORS); '*' for any. Default: pages "
                           f"on this machine, by http or https, and local apps ({Origins.DEFAULT}); "
                           "stock's default was '*'.")
        elif action.dest == "model" and action.help:  # stock's help, and what leaving it out does here
            action.help = (f"{action.help.rstrip('.')}: a folder or a Hugging Face id. Default: a tiny built-in "
                           "demo model, to try the server (it answers with sentences of a few built-in stories).")
    keep_stock_abbreviations(parser, stock_flags)
    parser.description = DESCRIPTION
    parser.epilog = other_commands_help()
    # Keeps the epilog's lines; flags' help texts are wrapped as before.
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def keep_stock_abbreviations(parser: argparse.ArgumentParser, stock_flags: list[str]) -> None:
    """Every abbreviation of a stock flag that stock's parser takes still means that flag.

    argparse takes any unambiguous prefix of a long flag; ours beside stock's made some of
    stock's ambiguous (``--log`` for ``--log-level`` met ``--log-format``: exit 2 where stock
    started). Each such prefix is made an exact name of the stock flag's action, which the
    help does not list."""
    options = parser._option_string_actions  # noqa: SLF001 - argparse has no public way to add a name
    for flag in stock_flags:
        for end in range(3, len(flag)):
            prefix = flag[:end]
            if prefix in options or [f for f in stock_flags if f.startswith(prefix)] != [flag]:
                continue  # a name already, or not stock's own abbreviation of this flag
            if any(other.startswith(prefix) for other in options if other not in stock_flags):
                options[prefix] = options[flag]


def other_commands_help() -> str:
    lines = ["other commands:"]
    for usage, summary in [*((f"mlx-guardian {name} {args}", summary)
                             for name, (_, args, summary) in COMMANDS.items()),
                           ("mlx-guardian --supervise [flags]", SUPERVISE_SUMMARY)]:
        lines.append(f"  {usage}")
        lines.append(textwrap.fill(summary, width=79, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def prepare(namespace: argparse.Namespace) -> None:
    """After stock parsed the flags: logging, config, plugins, demo model."""
    from guardian.distributed.group import current_group

    # Under mlx.launch every rank logs to the launcher's one stderr: each line says which.
    namespace.guardian_group = current_group()
    if namespace.guardian_group is not None:
        bind_process(rank=namespace.guardian_group.rank)
    configure_logging(namespace.log_format or CoreSettings.log_format.default, namespace.log_level)
    try:
        live, pm = load_runtime(namespace, namespace.guardian_config)
    except ConfigError as e:
        live, pm = start_from_version_in_force(namespace, e)
    in_force.keep(live.file_version)  # for the next child, if a supervisor's
    # Keys set away from their defaults: the example file's table, every key at its default, is no news.
    unused = [key for key in live.file_version.core_keys.get(SupervisorSettings.table_name, ())
              if getattr(live.file_version.supervisor, key) != SupervisorSettings.settings[key].default]
    if unused and not started_by_supervisor():
        # The table is read by a supervisor alone: a file that sets one (launch_args, engine)
        # for a process started without --supervise ran in-process with no word of it.
        log.warning("supervisor_table_unused", file=str(namespace.guardian_config), keys=list(unused),
                    hint=f"[supervisor] is read in subprocess mode alone: start with {CommandLine.supervise.flag}")
    live.on_change(lambda change: in_force.keep(live.file_version))
    if namespace.model is None:
        from guardian.demo_model import UNWRITABLE_HINT, ensure_demo_model

        try:
            namespace.model = str(ensure_demo_model())
        except OSError as e:  # a cache folder it cannot write (a read-only home, a service's sandbox)
            log.critical("model_load_failed", model="demo", error_type=type(e).__name__, error_message=str(e))
            print(f"mlx-guardian: cannot write the demo model: {e}. {UNWRITABLE_HINT}", file=sys.stderr)
            raise SystemExit(EXIT_BOOT_ERROR) from None
        log.info("demo_model_selected", model=namespace.model)
    namespace.guardian_runtime = (live, pm)


def load_runtime(namespace: argparse.Namespace, path, source=None):
    """The live configuration and the plugins, from the file at ``path`` (read as the
    file at ``source``, which is watched, when given); ConfigError if it does not do."""
    from guardian.config.live import LiveConfig
    from guardian.plugin_manager import check_plugin_list, make_plugin_manager

    config = load_config(path)
    if source is not None:
        config.source = Path(source)
    config.core = config.core.with_flags(namespace)
    config.access = config.access.with_flags(namespace)
    # A key file that does not parse stops the start, as a bad config file does. The door
    # takes these keys once the model has loaded: a file saved meanwhile is a reload then
    # (a bad one keeps these), not a second read that could fail after the load. A
    # supervised child lets in its supervisor alone, and reads none.
    namespace.guardian_keys = KeyRing(None if started_by_supervisor() else config.access.api_key_file or None)
    # Plugins and the core read their settings through it: the file may change.
    live = LiveConfig(config, flags=namespace, check_plugins=check_plugin_list)
    configure_logging(config.core.log_format, live.log_level())
    keep_stock_request_lines(config.core.stock_request_logs)
    return live, make_plugin_manager(config, live=live)


def start_from_version_in_force(namespace: argparse.Namespace, error: ConfigError):
    """A supervised child whose file does not parse starts from the version the last
    child ran (guardian.config.in_force); anyone else stops: exit 2."""
    kept = in_force.kept_version()
    if kept is not None and namespace.guardian_config is not None:
        try:
            live, pm = load_runtime(namespace, kept, source=namespace.guardian_config)
        except ConfigError as kept_error:
            log.error("config_in_force_invalid", error_message=str(kept_error))
        else:
            log.error("config_invalid_kept_in_force", error_message=str(error),
                      file=str(namespace.guardian_config),
                      hint="the version the last child ran is in force; the next good save of the file applies")
            live.start_failure(str(error))
            return live, pm
    log.critical("config_invalid", error_message=str(error))
    print(f"mlx-guardian: {error}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE) from None


def run(host, port, model_provider, *args, **kwargs):
    """Replaces stock ``run``; stock ``main()`` calls it after parsing."""
    from guardian.serving.assembly import serve

    live, pm = model_provider.cli_args.guardian_runtime
    group = model_provider.cli_args.guardian_group
    if group is not None and not group.leader:
        # As stock: only rank 0 serves HTTP; the others follow its broadcast.
        from guardian.serving.follower import serve_follower

        code = serve_follower(model_provider, live, pm, group)
    else:
        try:
            code = serve(host, port, model_provider, live, pm, group)
        except KeyboardInterrupt:  # Ctrl-C before serve takes SIGINT over: as while the model loads (main)
            raise
        except Exception:  # a bug: said, then an exit, never a process left up on its engine's thread
            log.critical("server_failed", exc_info=True)
            code = EXIT_UNCAUGHT
    # A loop thread stuck in native code can never be joined, and stock's
    # own generation thread is not a daemon: leave without waiting for them.
    leave_for_supervisor(code)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


def demo_model_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mlx-guardian demo-model", description=COMMANDS["demo-model"][2])
    parser.add_argument("path", type=Path, help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0,
                        help="0: the trained weights; any other seed: random ones (output is not words)")
    args = parser.parse_args(argv)
    from guardian.demo_model import write_demo_model

    try:
        print(write_demo_model(args.path, seed=args.seed))
    except OSError as e:  # there already, a parent that is a file, or one it may not write
        why = "it already exists" if args.path.is_dir() else (e.strerror or str(e))
        print(f"mlx-guardian: cannot write the demo model to {args.path}: {why}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def plugins_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mlx-guardian plugins", description=COMMANDS["plugins"][2])
    CommandLine.guardian_config.add_flag(parser)
    args = parser.parse_args(argv)
    from guardian.plugin_manager import describe, make_plugin_manager

    try:
        pm = make_plugin_manager(load_config(args.guardian_config))
    except ConfigError as e:
        print(f"mlx-guardian: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(describe(pm), indent=2))
    return 0


def check_config_command(argv: list[str]) -> int:
    """The file checked as a start checks it, nothing served: its tables and values, the
    plugins it names and their tables, its API key file, what --engine stock reads. For a
    deploy to try a file before it is saved over the one in force (as nginx -t)."""
    parser = argparse.ArgumentParser(prog="mlx-guardian check-config", description=COMMANDS["check-config"][2])
    parser.add_argument("path", type=Path, help="the file a server is given as --guardian-config")
    args = parser.parse_args(argv)
    from guardian.plugin_manager import make_plugin_manager
    from guardian.supervise.settings import check_stock_tables

    configure_logging("console")  # what the reads warn of (a key file others may read), for a person
    try:
        config = load_config(args.path)
        make_plugin_manager(config)
        check_stock_tables(config, config.supervisor.engine)
        KeyRing(config.access.api_key_file or None)
    except ConfigError as e:
        print(f"mlx-guardian: {e}", file=sys.stderr)
        return EXIT_USAGE
    keys = {**config.core_keys, **{name: tuple(table) for name, table in config.plugin_tables.items()}}
    print(f"{args.path}: valid" + ("" if any(keys.values()) else ", every setting at its default"))
    for table in config.tables:
        if keys.get(table):
            print(f"  [{table}] {', '.join(keys[table])}")
    return 0


# name: (function, arguments, what it does), for main() and --help.
COMMANDS = {
    "plugins": (plugins_command, "[--guardian-config FILE]",
                "print the plugins loaded (built-in, entry points, the config's) and the hooks each implements"),
    "demo-model": (demo_model_command, "PATH [--seed N]",
                   "write the small demo model (served when --model is not given) into PATH"),
    "check-config": (check_config_command, "FILE",
                     "check a --guardian-config file as a start would (its values, plugins, key file) "
                     "and say what it sets; exit 2 and the error otherwise. Nothing is served."),
}
SUPERVISE_SUMMARY = ("subprocess mode: a supervisor runs the server as a child process and replaces it "
                     "when it dies; its own flags: mlx-guardian --supervise --help")


class HeldSighup:
    """SIGHUP's default action ends the process. Until the server installs its reload
    (guardian.serving.assembly.serve), one that comes while the model loads
    (``systemctl reload``, a supervisor passing one on to a child still starting) is
    held, and the server reloads once it serves (``pending``)."""

    pending = False

    def __call__(self, signum, frame) -> None:
        self.pending = True


def main(argv: list[str] | None = None) -> None:
    try:
        run_command(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:
        # Ctrl-C before the server takes SIGINT over (while the model loads, say): one
        # line, not Python's traceback, and the same end (killed by SIGINT, which
        # systemd counts as a clean stop and a shell as an interrupt).
        print("mlx-guardian: interrupted", file=sys.stderr)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(128 + signal.SIGINT) from None  # where the signal is not fatal


def supervisor_flags() -> set[str]:
    """The flags only subprocess mode takes ([supervisor]'s)."""
    return {setting.flag for setting in SupervisorSettings.settings.values() if setting.flag}


def run_command(argv: list[str]) -> None:
    # First: a supervisor's child, or a group's rank, whose supervisor or launcher goes while
    # it imports and loads its model leaves.
    leave_with_supervisor_before_serving()
    leave_with_launcher_before_serving()
    signal.signal(signal.SIGHUP, HeldSighup())
    # Every connection held is a file descriptor (the door holds thousands).
    raise_open_files_limit()
    if argv and argv[0] in COMMANDS:
        command = COMMANDS[argv[0]][0]
        raise SystemExit(command(argv[1:]))
    short = [arg for arg in argv if arg != CommandLine.supervise.flag and len(arg) >= 4
             and CommandLine.supervise.flag.startswith(arg)]
    if short:  # argparse would take it for --supervise, and this process would run without one
        print(f"mlx-guardian: {short[0]} is short for {CommandLine.supervise.flag}: spell it in full",
              file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    theirs = [arg for arg in argv if arg.partition("=")[0] in supervisor_flags()]
    if theirs and CommandLine.supervise.flag not in argv:
        # argparse said only "unrecognized arguments", not which mode takes them.
        print(f"mlx-guardian: {theirs[0].partition('=')[0]} is a flag of subprocess mode: add "
              f"{CommandLine.supervise.flag} (mlx-guardian {CommandLine.supervise.flag} --help lists its flags)",
              file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    if CommandLine.supervise.flag in argv:
        # Subprocess mode: the supervisor must carry no mlx, so guardian.stock
        # (which imports mlx_lm) is only imported below, for the engine.
        from guardian.supervise.supervisor import main as supervise

        raise SystemExit(supervise(argv))
    from guardian import stock

    sys.argv = ["mlx-guardian", *argv]
    stock.handler.run_stock_main(run, add_arguments=add_guardian_arguments, after_parse=prepare)
