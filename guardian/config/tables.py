"""The core's settings: the tables the core reads from ``--guardian-config``.

``[guardian]`` configures the core, ``[watchdog]`` the watchdog,
``[supervisor]`` subprocess mode; every other table belongs to the plugin of
that name, which declares it like these (``guardian.config.registry``). A key
nobody declared, or a value of the wrong type, stops the server at start
with a message naming the key. config/guardian.example.toml is written from
these declarations (``python -m guardian.config.reference``).
"""

from __future__ import annotations

from guardian.config.registry import ACTIONS, Bool, FilePath, Float, Int, ListOf, OneOf, Setting, Str, Table, UrlPath


SECONDS = Float(min=0)
POSITIVE_SECONDS = Float(above=0)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class CommandLine(Table, name="command line", in_toml=False):
    """Flags with no key in the file: which file to read, which mode to run in."""

    guardian_config = Setting(Str(), None, "TOML file: plugins and their settings "
                              "(see config/guardian.example.toml)", flag="--guardian-config", metavar="FILE")
    supervise = Setting(Bool(), False, "subprocess mode: run the engine as a child process and "
                        "replace it when it dies (`mlx-guardian --supervise --help`)", flag="--supervise")


class CoreSettings(Table, name="guardian"):
    plugins = Setting(ListOf(Str()), [], """
        Extra plugins: "package.module" or "package.module:Class". Plugins
        installed with an entry point in the "mlx_guardian" group load by themselves.""")
    disabled_plugins = Setting(ListOf(Str()), [], """
        Plugins to leave out, by name (see `mlx-guardian plugins`); a name no plugin
        has stops the start. A plugin left out leaves its table in the file unread.""")
    log_format = Setting(OneOf("json", "console"), "json", """
        "json" (one JSON object a line, on stderr) or "console" (for people).""",
        flag="--log-format")
    log_level = Setting(OneOf("", *LOG_LEVELS), "", """
        The log level: "DEBUG", "INFO", "WARNING", "ERROR" or "CRITICAL". "": the
        --log-level flag's (default INFO). Set here, it wins over the flag, so that
        an edit of the file changes it while the server runs.""", live=True)
    stock_request_logs = Setting(Bool(), False, """
        Keep stock's own INFO lines for each request (its prompt-cache tables and
        prefill progress, six lines a chat completion) at INFO. false: they are
        written at DEBUG, and a request writes one line at INFO, its http_access.
        Stock's warnings and errors are written either way.""", live=True)
    retry_after_s = Setting(SECONDS, 1.0, """
        Seconds clients are told to wait (Retry-After) on a 503 while the engine
        restarts, in-process or, with --supervise, as a new child process.""", live=True)
    request_timeout_s = Setting(SECONDS, 0.0, """
        A completion request still unanswered this long after it arrived is
        stopped and answered 504 deadline_exceeded (a stream under way: an error event).
        Under --supervise it arrived at the public port: time held there while no
        child was ready, and a stream's time on a child that died, count too.
        A client's own read timeout, which the openai SDK sends as
        x-stainless-read-timeout, is a deadline too, the sooner winning: for a
        stream, until its head is sent (the client's limit is on each wait for
        bytes, and the events keep those short: a stream with no token for
        stream_keepalive_s, while a step is slow or the engine is replaced,
        is sent a keepalive comment). 0: none but the client's.""", live=True)
    stream_keepalive_s = Setting(Float(min=0, max=60), 1.0, """
        A stream under way that has had no token for this long is sent an SSE
        comment (": keepalive"), and again each time as long again: while a step
        is slow, the engine is replaced, or (--supervise) the next child starts.
        A client's read timeout (httpx's, the openai SDK's timeout=) counts each
        wait for bytes. In-process it is sent at the watchdog's next look
        ([watchdog] interval_s) after this. 0: none (clients that choke on SSE
        comments; their read timeout must then outlast a restart).""", live=True)
    exit_grace_s = Setting(SECONDS, 5.0, """
        On exit (SIGTERM, SIGINT), how long requests in flight get to reach their
        clients; the watchdog still acts meanwhile. Those still running then get 503
        server_stopping (a stream, its error event), written within a second more.
        A second signal, a second or more after the first, ends the wait at once.""", live=True)
    max_stop_sequences = Setting(Int(min=0), 32, """
        A request's "stop" may hold at most this many strings (400 otherwise;
        OpenAI's API takes 4). Stock builds its matcher from them on the loop
        every request shares: 50,000 strings of 10 characters (a 600 KB body)
        held every other request ~4.5 s, one of 500,000 characters ~7 s.
        0: no limit.""", live=True)
    max_stop_chars = Setting(Int(min=0), 256, """
        Each string in a request's "stop" may be at most this many characters
        (400 otherwise). 0: no limit.""", live=True)
    allowed_models = Setting(ListOf(Str()), [], """
        Models a request may name in "model", "draft_model" or "adapters" besides
        those the server was started with (--model, --adapter-path, --draft-model),
        as the request spells them (a path or a hub id). Any other name: 404
        model_not_found, and nothing is loaded.""")
    allow_any_model = Setting(Bool(), False, """
        Stock's behaviour: a request may make the server load any local path or
        hub id (one client can then run the machine out of memory).""")


class WatchdogSettings(Table, name="watchdog"):
    enabled = Setting(Bool(), True, """
        false: the watchdog neither judges progress (no stall is ever detected) nor
        runs probes, as for a debugger's breakpoint; /readyz then follows the
        engine's state alone. Memory samples, stream keepalives and systemd's
        pings go on.""")
    interval_s = Setting(Float(min=0.01, max=10.0), 0.25, """
        How often the watchdog looks at the engine (at most every 10 s: the
        stall checks, probes and samples all wait for its looks).""", live=True)
    stall_timeout_s = Setting(Float(min=0.5), 30.0, """
        The longest the heartbeat (engine steps, prompt progress) may stop while
        work waits, and the limit whenever the engine's pace is unknown: until
        the loop (after start or a restart) has completed a step, and while a
        request the loop took (a continuation after a failure too) has no token of
        that run and has not yet had a step go by since the watchdog first saw it
        so (its first prefill chunk, of a size the watchdog cannot see).""", live=True)
    stall_min_s = Setting(Float(min=0.5), 3.0, """
        The shortest: a stall needs the heartbeat stopped at least this long,
        however fast the engine's steps are. Far above a healthy engine's pauses
        (garbage collection, a new shape's kernels, a busy CPU) and, with a
        watchdog look every interval_s, a step that never returns is reported
        within about 3.3 s. Set it to stall_timeout_s for a fixed timeout.""", live=True)
    stall_pace_factor = Setting(Float(min=1.0), 4.0, """
        Otherwise the limit is this many times the longest gap between
        heartbeats in the last pace_samples looks: steps slow down as the batch
        grows, and each chunk of a long prompt attends to more context than the
        one before (up to twice as much from the second chunk on).""", live=True)
    stall_busy_extra_s = Setting(Float(min=0), 30.0, """
        A step that outlasts the stall limit while the engine's threads compute
        (kernels compiling, a long prefill on the CPU) or page (memory read back
        from swap: at least 20 major page faults a second) may run this much
        longer before it is a stall; a step that waits (a deadlock: no CPU, no
        paging) is a stall at the limit. Computing is judged by the engine's
        threads' own CPU time (Linux; elsewhere, and on the ranks of an
        mlx.launch group, whose waits in a collective use CPU, only paging is
        seen: on macOS the whole process's). 0: no extra time. Meanwhile /readyz says 503, "a step computes or
        pages past the stall limit", and a supervisor waits for this verdict.""", live=True)
    pace_samples = Setting(Int(min=1), 32, """
        How many of the watchdog's looks at a moving heartbeat the pace
        remembers: about 8 s of fast steps (one look every interval_s), or the
        last 32 steps of a model slower than that.""", live=True)
    restart_timeout_s = Setting(Float(min=0.05), 120.0, """
        A restart or reload that has not produced a working loop after this long
        counts as a stall as well.""", live=True)
    ladder = Setting(ListOf(OneOf(*ACTIONS), min_items=1), list(ACTIONS), """
        What each stall within ladder_window_s does, in order; the last rung repeats.
        A stall after a user's request was served since the last one starts at the
        first rung again. "restart": abandon the stuck loop thread, start a fresh one on the loaded
        weights; "reload": the same after reading the weights again; "exit": answer
        every request and exit with code 5 for launchd or systemd. A stall laid to a
        request (blamed for it, or stalled alone at its point again and awaiting the
        probe that proves the engine before it is blamed) restarts and is not counted.""", live=True)
    ladder_window_s = Setting(SECONDS, 600.0, """
        Stalls within this many seconds of each other climb the ladder one rung
        each; a stall after a quiet window starts at its first rung.""", live=True)
    max_abandoned_loops = Setting(Int(min=0), 4, """
        A loop thread a stall replaced lives as long as the process: one stuck in a
        step cannot be killed, and one whose step returns is parked (its exit would
        destroy what mlx keeps per thread, under the live loop's work on a GPU). Each
        holds its own stream and threads, and a stuck one its batch's memory too
        (/guardian/status: abandoned_loop_threads). Once
        this many are alive, a stall takes the exit rung, whatever the ladder says, so
        that launchd or systemd starts a clean process; stalls far apart, each after
        requests were served, would otherwise never leave the first rung. 0: no limit.""",
        live=True)
    unwind_timeout_s = Setting(Float(min=1.0, max=60.0), 5.0, """
        A loop thread a stall replaced whose stuck step then returns unwinds (frees
        its batch) while the live loop waits between two steps: on a GPU the two
        threads' work must not interleave. The live loop waits this long at most,
        then goes on (abandoned_loop_slow_to_leave) while the old thread finishes
        unwinding. The watchdog judges no stall during the wait, so at most 60 s; at
        least 1 s: a shorter one lets the two threads' work interleave whenever a batch
        takes longer to free.""", live=True)
    probe_interval_s = Setting(Float(min=0.05), 30.0, """
        Synthetic probes run this often while the engine is idle (never while it
        visibly progresses: progress is the proof then).""", live=True)
    probe_retry_s = Setting(Float(min=0.05), 5.0, """
        After a failed probe, the next runs this long after it ended, once the
        engine is idle and ready, and twice as long after each further failure
        (at most probe_interval_s): /readyz said 503 until the next
        probe_interval_s, and a supervisor replaced the child meanwhile. Where
        only the built-in generation probe failed, a user's request that
        completes since makes the engine ready at once.""", live=True)
    probe_timeout_s = Setting(Float(min=0.05), 10.0, """
        A probe's deadline: the built-in probe's token must come within it, and a
        plugin's probe still running a second past it is a failed result.""", live=True)
    probe_max_age_s = Setting(Float(min=0.05), 120.0, """
        /readyz wants a passed probe at most this old, or visible progress.""", live=True)
    deep_check_reuse_s = Setting(Float(min=0, max=60.0), 1.0, """
        A deep readiness check (/readyz?deep=1, public: no key) is answered by a
        probe round begun at most this many seconds before it, where there is one,
        instead of a round of its own: checks run at most one round this often,
        whoever sends them (one client looping on it ran ~180 rounds a second, a
        core busy, on an idle server). Checks that come while a round runs share
        the next one whatever this is. 0: a round for every check; at most 60 (past
        that a "deep" check would answer from a round of any age).""", live=True)
    resource_interval_s = Setting(Float(min=0.05), 5.0, """
        Resource samples (memory counters, cache entries) for /guardian/status.""", live=True)
    peer_timeout_s = Setting(Float(min=0.1), 10.0, """
        Under mlx.launch: a rank silent this long on the group's control connection
        (stopped, or wedged with its interpreter held) is lost, as is one whose
        process is gone (seen at once); every rank then exits with code 7, rank 0
        after answering its clients 503 + Retry-After. Each rank sends a beat ten
        times within it.""")
    join_timeout_s = Setting(Float(min=0.1), 30.0, """
        Under mlx.launch: how long rank 0 waits for every other rank to open its
        control connection, and a rank to reach rank 0, once they met in the
        group's first collective. Past it the rank logs group_join_failed and
        exits with code 7: a rank that cannot reach the address rank 0 listens
        on (a firewall; an address of another network).""")


class SupervisorSettings(Table, name="supervisor"):
    """Subprocess mode (--supervise): the supervisor process reads this table.
    With --engine stock it is the only table the file may have. A process started
    without --supervise does not read it, and says so (supervisor_table_unused)."""

    engine = Setting(OneOf("guardian", "stock"), "guardian", """
        The child: the in-process guardian, or stock mlx_lm server unchanged.""", flag="--engine")
    interval_s = Setting(POSITIVE_SECONDS, 1.0, """
        Seconds between health checks of the child.""", flag="--supervisor-interval", metavar="S")
    unhealthy_after_s = Setting(POSITIVE_SECONDS, 30.0, """
        Replace a child whose checks fail for this many seconds.""",
        flag="--supervisor-unhealthy-after", metavar="S")
    unanswered_after_s = Setting(POSITIVE_SECONDS, 10.0, """
        Replace sooner a child whose checks get no answer at all for this many
        seconds (frozen: SIGSTOP, a stopped cgroup; starved). A guardian child
        answers its checks while its engine recovers, with 503; one that answers
        none takes no new request meanwhile: they wait for it to answer again,
        or for its replacement (hold_requests, hold_s).""",
        flag="--supervisor-unanswered-after", metavar="S")
    start_timeout_s = Setting(POSITIVE_SECONDS, 600.0, """
        Replace a child not ready after this many seconds; raise it for a model
        downloaded at first start.""", flag="--supervisor-start-timeout", metavar="S")
    kill_grace_s = Setting(POSITIVE_SECONDS, 10.0, """
        Seconds between SIGTERM and SIGKILL when a child is stopped; when the
        supervisor itself stops, at least the child's drain ([guardian] exit_grace_s)
        and 2 s for its last answers.""",
        flag="--supervisor-kill-grace", metavar="S")
    max_restarts = Setting(Int(min=0), 5, """
        Give up (exit 6) at the first restart past this many within window_s (the
        crashes of a request quarantined by a child that had been ready do not count,
        and a child that completed users' requests forgives the restarts before it).""",
        flag="--supervisor-max-restarts", metavar="N")
    child_verdict_wait_s = Setting(Float(above=0, max=60.0), 3.0, """
        A save is put in force at the supervisor once the ready child runs that
        version too, and not at all if the child refuses it (a plugin's table wrong,
        which the supervisor cannot check): after a SIGHUP, only the child's word
        since it counts. The supervisor waits this long for that word; without it
        (the child busy, stopped or starting) it puts the version in force, and logs
        supervisor_config_applied_without_child_verdict where it changes what the
        supervisor acts on ([access], [http], [guardian]).""")
    boot_attempts = Setting(Int(min=1), 2, """
        Children in a row that may fail to load the model (exit 3, or a stock
        child's /health 503 while it starts) before the supervisor exits 3
        itself, the reason intact, leaving slower retries to
        systemd's RestartSec or launchd's ThrottleInterval. More than 1: a load may
        meet a passing shortage (memory a dying process still held).""")
    window_s = Setting(POSITIVE_SECONDS, 300.0, """
        The crash-loop window in seconds, of the supervisor's time less the time
        its children spent starting (a large model's minute-long loads would put
        six restarts of children that crash at once past any window).""",
        flag="--supervisor-window", metavar="S")
    quarantine_s = Setting(SECONDS, 300.0, """
        Refuse for this many seconds a request that was in flight at two child
        crashes within window_s; 0: off.""", flag="--supervisor-quarantine", metavar="S")
    isolation_wait_s = Setting(SECONDS, 30.0, """
        A request in flight at a crash (a suspect) runs alone the next time, so that
        a second crash names it alone: requests that come meanwhile wait behind it
        this long at most, then go in beside it. A suspect waits as long for the
        requests before it to end, then goes in beside them, unless another suspect
        runs alone (503 crash_check_busy + Retry-After); its wait starts again each
        time a suspect's turn alone ends (suspects take their turns in the order
        they came, so the whole wait grows with those ahead). Each wait ends sooner
        at its request's deadline.""",
        flag="--supervisor-isolation-wait", metavar="S")
    hold_requests = Setting(Int(min=0), 64, """
        Requests that may wait for a ready child while none is (starting,
        restarting); past this many, 503 + Retry-After at once. 0: no waiting.
        A client with [access] client_max_concurrent requests waiting already
        gets 429 at once, as the child would answer it, and takes no place.""",
        flag="--supervisor-hold-requests", metavar="N")
    hold_s = Setting(SECONDS, 30.0, """
        How long a request waits for a ready child before its 503 + Retry-After.""",
        flag="--supervisor-hold", metavar="S")
    idle_stop_s = Setting(SECONDS, 0.0, """
        A child that has had no request for this long is stopped, and the memory it
        held (the model's weights, mlx's caches) given back to the machine; the next
        request starts a new one and waits for it, as requests wait while a child
        restarts (hold_s, hold_requests: set hold_s above the model's load time).
        Meanwhile the supervisor answers /health and /readyz itself, 200 (state
        "idle"). Not a restart: nothing is struck or counted. 0: never.""",
        flag="--supervisor-idle-stop", metavar="S")
    max_resends = Setting(Int(min=0), 1, """
        A request whose child died before any byte of the answer reached the client
        is sent again to the next child, at most this many times (a request in
        flight at two crashes is quarantined first). 0: 503 + Retry-After instead.
        A stream cut by its child's death is continued on the next child this many
        times at one point: one that progressed since its last cut counts from 0.""",
        flag="--supervisor-max-resends", metavar="N")
    deadline_backstop_s = Setting(POSITIVE_SECONDS, 2.0, """
        A completion's deadline (request_timeout_s, or the client's read
        timeout) is the child's to keep: a 504, or a stream's error event. A
        child still silent this long past it keeps none (frozen: SIGSTOP, a
        stopped VM; or --engine stock, which keeps none): a relayed request is
        answered by the supervisor, and a child holding a handed-off one
        answers no check is replaced, which answers it.""",
        flag="--supervisor-deadline-backstop", metavar="S")
    reap_wait_s = Setting(POSITIVE_SECONDS, 5.0, """
        How long a request whose child closed its connection without an answer
        waits for that child's death to be seen: a crash is reaped within
        milliseconds (a GPU's teardown can take a second), and the request is sent
        again. A child alive after this long dropped it on its own (stock does
        when its handler fails on a request): 502 engine_dropped_request, not to
        be retried. The request's deadline and its client leaving end the wait.""",
        flag="--supervisor-reap-wait", metavar="S")
    # At most 5: the supervisor's checks run on its main loop (signals, reaping, kills). A
    # longer one was taken and cut to 5 without a word.
    health_timeout_s = Setting(Float(above=0, max=5.0), 1.0, """
        A check of the child (the supervisor's own, each interval) fails if not
        answered within this many seconds (5 at most: it runs on the supervisor's
        main loop). The public /health and /readyz relay
        the child's answer only if it comes within it too; otherwise, and whenever
        the supervisor holds the child unhealthy, they answer 503 from the
        supervisor's own checks.""",
        flag="--supervisor-health-timeout", metavar="S")
    hand_off = Setting(Bool(), True, """
        Hand each relayed request's connection to the child (SCM_RIGHTS), which
        answers on it directly: a stream then costs the supervisor nothing per
        token. The supervisor keeps a copy and a journal of the child's writes,
        so a child's death is handled as when relaying (the request sent again,
        or its stream continued on the next child). Used where the kernel counts
        a socket's bytes (Linux) and the port is plain HTTP with a guardian child,
        one process; elsewhere, and with false, every byte is relayed.""")
    handoff_pause_s = Setting(SECONDS, 30.0, """
        A child that could not open a hand-off (mapping its journal failed: out of
        memory, or of mappings) is sent that request again and, for this many
        seconds, every request relayed, before hand-offs are tried again: a child
        that can never open one costs each request no failed hand-off. 0: no pause.""")
    launch_args = Setting(Str(), "", """
        Run the server as an mlx.launch group instead of one process: mlx.launch's
        own arguments (hosts or hostfile, backend, ...), e.g. "--backend ring -n 2".
        The supervisor starts mlx.launch with them and mlx-guardian as its program,
        checks rank 0's /readyz (rank 0 runs on this machine), and replaces the whole
        group (its process group) when any rank dies, stalls or the group exits.
        "": one process.""", flag="--launch-args", metavar="ARGS")


class AccessSettings(Table, name="access"):
    """Who may come in (guardian.access): API keys, protected mode, browsers'
    origins and Host names, per-client limits and TLS. In one process the
    server applies it; with --supervise the supervisor's public port does, and
    the child, on loopback, serves only the supervisor."""

    api_key_file = Setting(FilePath(), "", """
        A file of API keys, one a line: "KEY" or "NAME:KEY", where KEY may be
        "sha256:<hex>" (the key's SHA-256, so the file need hold no secret); "#"
        starts a comment. Once it holds a key, every path but public_paths needs
        one (Authorization: Bearer KEY, or X-Api-Key: KEY). Followed live: a save
        or SIGHUP reads it again; a file with a bad line adds no key but revokes
        those it no longer holds, and a file gone revokes every key. Relative,
        in this file: to this file's folder. "": no keys.""", flag="--api-key-file", metavar="PATH")
    public_paths = Setting(ListOf(UrlPath()), ["/livez", "/readyz", "/health"], """
        Paths served without a key (and to any address in protected mode):
        health checks for load balancers and supervisors. Exact paths; the
        query string is not part of it.""", live=True)
    protected_mode = Setting(Bool(), True, """
        Bound beyond loopback (--host 0.0.0.0, say) with no API key configured,
        answer requests from other addresses 403, saying how to add keys; loopback
        clients are served as always. false: serve everyone without keys (a
        trusted network, or a proxy in front that checks them).""", live=True)
    allowed_hosts = Setting(ListOf(Str()), [], """
        Host header names served besides loopback names and addresses, which
        always are, and, bound beyond loopback, IP addresses and this machine's
        host name (and NAME.local; in protected mode, from other machines only):
        "name", ".example.com" (the domain and its
        subdomains) or "*" (any). A web UI in a container that names this
        machine: "host.docker.internal". Behind a proxy that forwards its clients'
        Host to a server bound to loopback, list the proxy's public name here.
        Another name is refused (403): a web page cannot reach the server
        through a DNS name it controls (DNS rebinding).""", live=True)
    client_max_concurrent = Setting(Int(min=0), 0, """
        Requests for completions each client (API key; client address when
        there are no keys) may have in flight at once; past it, 429
        rate_limit_exceeded with Retry-After: 1 (a place frees as soon as one
        of its requests ends). 0: no limit.""", live=True)
    client_tokens_per_minute = Setting(Int(min=0), 0, """
        Tokens (prompt and generated) each client may use within any minute.
        A request reserves its prompt and its max_tokens (stock's --max-tokens
        when it sends none; at most what the context leaves) at admission; once
        it ends, what it did not generate is given back. One that would take
        the client's used and reserved tokens past the limit gets 429
        rate_limit_exceeded with Retry-After until enough of the minute has
        passed; one that alone needs more than the limit is let in only when
        the client has nothing counted. 0: no limit.""", live=True)
    fair_admission = Setting(Bool(), True, """
        When requests wait for the engine, take them round-robin across clients
        (API keys; addresses when there are no keys) instead of first come, first
        served, so that one client's burst cannot delay everyone else's.""", live=True)
    fair_admission_recent_s = Setting(SECONDS, 60.0, """
        With fair_admission, the batch's last free place is kept for a client
        that sent a request within this many seconds and has none in flight, so
        that its next one starts at once beside another client's flood (which
        runs one place short meanwhile). 0: no place is kept.""", live=True)
    ssl_certfile = Setting(FilePath(), "", """
        Serve HTTPS with this certificate (PEM, the chain after it); read
        again on SIGHUP. Relative, in this file: to this file's folder. "": plain
        HTTP.""", flag="--ssl-certfile", metavar="PATH")
    ssl_keyfile = Setting(FilePath(), "", """
        The certificate's private key (PEM). Relative, in this file: to this
        file's folder. "": in ssl_certfile.""",
        flag="--ssl-keyfile", metavar="PATH")


class HttpSettings(Table, name="http"):
    """What the door holds (guardian.serving.connection): both HTTP servers read every
    request's headers and body under deadlines before a handler thread sees it,
    and bound their handler threads. Live, at the supervisor's public port too."""

    header_timeout_s = Setting(POSITIVE_SECONDS, 10.0, """
        A connection's request headers must be complete this long after it
        opened; else 408 and the close.""", live=True)
    body_timeout_s = Setting(POSITIVE_SECONDS, 30.0, """
        The body must be complete this long after the headers; else 408.""", live=True)
    idle_timeout_s = Setting(POSITIVE_SECONDS, 5.0, """
        A connection that sends nothing for this long after it opened is closed
        without a word (as an idle keep-alive connection is).""", live=True)
    send_timeout_s = Setting(SECONDS, 30.0, """
        A write to a client that makes no progress for this long ends its
        request: the client stopped reading (nginx's send_timeout). 0: none.
        An answer the door writes itself (a refusal, a 408) waits at most 1 s,
        or this if less: a thread or the reader waits on it.""", live=True)
    linger_s = Setting(Float(min=0, max=30), 2.0, """
        How long the close of a request answered without reading its body (a
        refusal at the door, a body over the limit, a route that reads none, a
        408 to a client still sending) drops what its client still sends, so that the answer is not reset away
        before the client reads it (a web server's lingering close). Past it, or
        once the client closes, the connection is closed. 0: at once; at most 30
        (each holds a descriptor, and a client with no key can ask for one).""", live=True)
    max_lingering = Setting(Int(min=0), 1024, """
        Lingering closes (linger_s) at once, a descriptor each: past it, a close
        lingers no more and its answer may be reset away before its client reads
        it. 0: none lingers.""", live=True)
    send_buffer_bytes = Setting(Int(min=0, max=1 << 30), 256 * 1024, """
        The kernel's send buffer for each client connection (SO_SNDBUF): what a
        client that stopped reading can leave unsent before send_timeout_s
        starts to count, and the kernel memory it holds (autotuned, a buffer can
        grow to megabytes). 0: the system's autotuning.""", live=True)
    max_handlers = Setting(Int(min=0), 0, """
        Requests handled at once (each holds a thread; a stream for its life).
        Past it, a complete request gets 503 + Retry-After at once. 0: sized from
        the engine, --decode-concurrency plus [prompt_guard] max_queued (as it is
        now: it is live) plus 32 for health checks, refusals and streams ending
        (the supervisor: from the child's --decode-concurrency, plus [supervisor]
        hold_requests).""")
    max_header_bytes = Setting(Int(min=1024, max=1 << 30), 64 * 1024, """
        The request line and headers together; past it, 431 (414 where the request
        line alone is). One line of more than 64 KiB is refused whatever this is
        (414 for the request line, else 431): http.server reads no longer line.
        A supervised child reads up to 6 MiB more: what its supervisor adds, a
        continued stream's token ids among it.""", live=True)
    max_header_count = Setting(Int(min=16), 99, """
        Header lines; past it, 431 (at least 16: a client's usual few, and a proxy's). At most 99 whatever this is: http.server reads
        no more (it counts the blank line among its 100); under --supervise at most
        87 at the public port, which leaves room for the headers the supervisor adds.""", live=True)
    max_buffered_bytes = Setting(Int(min=0), 256 * 1024 * 1024, """
        Requests still arriving, in bytes, that the door holds in memory at once:
        each head as it comes (up to max_header_bytes), then, once it is whole,
        the head and its Content-Length together. A request whose head or whole
        would take it past this gets 503 + Retry-After at once, the rest unread
        (431 for a head, 413 for a request, larger than this alone): a thousand
        clients each sending 30 MB slowly held 30 GB, and heads of 64 KiB never
        finished were held with no bound on their number. 0: no limit.""", live=True)


# Tables the core reads; every other table is a plugin's.
CORE_TABLES = (CoreSettings, WatchdogSettings, SupervisorSettings, AccessSettings, HttpSettings)
