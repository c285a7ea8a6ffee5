"""A rank of an mlx.launch group other than 0: no HTTP, stock's loop fed by rank 0's broadcast."""

from __future__ import annotations

import signal

import structlog

from guardian import stock
from guardian.distributed.engine import GroupEngine
from guardian.distributed.group import Group
from guardian.distributed.member import GroupMember
from guardian.exit_codes import EXIT_BOOT_ERROR
from guardian.plugin_manager import notify
from guardian.serving.assembly import ServedModel
from guardian.serving.exit_request import ExitRequest

# A rank's events, as guardian.distributed.member logs them.
log = structlog.get_logger("guardian.group")


def serve_follower(model_provider, config, pm, group: Group) -> int:
    """A rank other than 0: no HTTP; stock's loop, fed by rank 0's broadcast, guarded."""
    exit_request = ExitRequest()
    # A LiveConfig (the file followed while serving), or a GuardianConfig.
    settings = getattr(config, "config", config)
    member = GroupMember(group, settings.watchdog.peer_timeout_s, exit_request, settings.watchdog.join_timeout_s)
    member.join(pm)
    try:
        model_provider.load_default()
    except Exception as e:
        log.critical("model_load_failed", model=model_provider.cli_args.model,
                     error_type=type(e).__name__, error_message=str(e), exc_info=True)
        member.failing(f"the model could not be loaded: {e}")
        member.leave(EXIT_BOOT_ERROR)
        return EXIT_BOOT_ERROR
    served = ServedModel(model_provider, config, pm, on_exit=exit_request.fail, engine_class=GroupEngine)
    member.watch(served.engine)
    # Start-up hooks as on rank 0 (the probe's prompt kept out of the prompt
    # cache: every rank's cache must hold the same entries), no watchdog:
    # this rank's stall stops rank 0's loop in a collective, and rank 0's
    # watchdog sees it there.
    notify(pm.hook.guardian_startup, engine=served.engine.plugin_view, config=served.config)
    # Rank 0 has the clients: a signalled rank asks it to stop the group, and leaves when
    # rank 0 has drained them and says so (the launcher or supervisor signals every rank
    # at once), or when rank 0 is lost. Rank 0 bounds its drain by its exit_grace_s, which
    # its configuration file may have changed since this rank read it.
    def asked_to_stop(*_):
        # Marked here, at once: the launcher's death that sent this SIGTERM is seen by the
        # parent watch's thread too, which must take it for the stop it is, not a failure.
        member.asked_to_stop = True
        # The asking logs and writes: on the main thread, not in the handler.
        exit_request.run_on_main_thread(member.ask_group_to_stop)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, asked_to_stop)
    # Only rank 0 follows the file: a SIGHUP here changes nothing, and says so (it was silent).
    signal.signal(signal.SIGHUP, lambda *_: exit_request.run_on_main_thread(lambda: log.info(
        "sighup_ignored", hint="only rank 0 reads --guardian-config again: send SIGHUP to rank 0")))
    log.info("rank_started", model=model_provider.cli_args.model,
             mlx_lm_version=stock.contract.STOCK_VERSION)
    code = exit_request.wait()
    exit_request.run_pending()  # a SIGTERM that came with rank 0's word to stop: asked, and logged
    stock.loop.stop_generation_thread(served.engine)
    notify(pm.hook.guardian_shutdown, engine=served.engine.plugin_view, exit_code=code)
    member.leave(code)
    log.info("rank_stopped", exit_code=code)
    return code
