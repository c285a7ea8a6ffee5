"""Stock's own server tests, run against the guardian: the drop-in claim, proven.

mlx-lm ships ``tests/test_server.py`` in the source distribution of every
release. This module fetches the sdist of the *installed* mlx-lm from the
package index (cached under ``.cache/stock-tests/``, never committed),
imports that file and changes only its fixture, by rebinding the names its
fixture uses in the imported module:

- ``DummyModelProvider`` (stock loads a hub model, Qwen1.5-0.5B-Chat-4bit)
  becomes stock's real ``ModelProvider``, built by stock's own ``main()``
  for ``--model DEMO`` (the guardian's offline demo model), serving that
  model under the two names the dummy answers to, ``default_model`` and
  ``chat_model``;
- ``ResponseGenerator`` becomes ``guardian.serving.assembly.ServedModel`` (the engine,
  admission and watchdog), built and started as ``guardian.serving.assembly.serve``
  does (``guardian_engine``: the one place to adapt when that changes);
- ``APIHandler`` becomes ``GuardianHandler`` and ``http.server.HTTPServer``
  the guardian's HTTP server (``guardian.serving.assembly.make_http_server``).

Every stock TestCase class is then exposed in this module's namespace, so
pytest reports each stock test as its own item. The tests that cannot pass
are listed once, in ``EXPECTED``, each with its reason; the "Stock's own
tests" section of docs/development.md repeats the list.
"""

from __future__ import annotations

import http.server
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import types
import unittest
from pathlib import Path

import pytest

from guardian import stock
from guardian.admission.facts import served_model_config
from guardian.admission.startup_checks import impossible_flags
from guardian.config.loading import load_config
from guardian.exit_codes import EXIT_BOOT_ERROR, EXIT_USAGE
from guardian.serving.handler import GuardianHandler
from guardian.plugin_manager import make_plugin_manager
from guardian.serving.assembly import ServedModel, make_http_server

REPO = Path(__file__).resolve().parent.parent
STOCK_VERSION = importlib.metadata.version("mlx-lm")
CACHE = Path(os.environ.get("MLX_GUARDIAN_STOCK_TESTS_CACHE", REPO / ".cache" / "stock-tests"))
# pip's own network timeout per attempt, and a bound on the whole download.
PIP_TIMEOUT_S = 15
DOWNLOAD_TIMEOUT_S = 120

# A hung request fails its test instead of the run (stock's requests have no timeout).
pytestmark = pytest.mark.timeout(60)


class GuardianWouldNotStart(Exception):
    """guardian.serving.assembly.serve would exit before serving; the message has its exit code and why."""


# --- the stock tests that cannot pass, and why: the one list --------------------------------
# Keys are "Class.test"; "versions": the mlx-lm version prefixes the entry is for (each
# of them has the test); "raises": how the test fails.
# docs/development.md's "Stock's own tests" section has one line per entry.
CHANGED = "behaviour changed on purpose: "
GUARDIAN_BUG = "GUARDIAN BUG: "
KV_FLAGS = ("the guardian refuses to start with flags that can never work (exit 2); the "
            "fixture's --kv-bits 4 --kv-group-size 64 cannot quantize the demo model's KV cache "
            "(head dimension 16), where stock starts and then fails every request")
EXPECTED = {
    "TestServer.test_health_endpoint": dict(
        outcome="xfail", raises=AssertionError, versions=("0.32.",),
        reason=CHANGED + "/health's body also names the engine's state "
        "({\"status\": \"ok\", \"state\": \"ready\"}, docs/recovery.md, \"The watchdog\"); "
        "stock's test compares the whole body"),
    "TestServerKVCacheQuantization.test_quantized_kv_disables_batching": dict(
        outcome="xfail", raises=GuardianWouldNotStart, versions=("0.32.",),
        reason=CHANGED + KV_FLAGS),
    "TestServerKVCacheQuantization.test_completion_quantizes_the_cache": dict(
        outcome="xfail", raises=GuardianWouldNotStart, versions=("0.32.",),
        reason=CHANGED + KV_FLAGS),
    "TestGenerationThreadDeath.test_generation_unavailable_after_thread_crash": dict(
        outcome="xfail", raises=GuardianWouldNotStart, versions=("0.32.",),
        reason=CHANGED + "the guardian loads the model before its engine starts, as serve() "
        "does (a failed load exits with code 3), and never leaves a dead generation thread "
        "behind; the test reads stock's _generation_failed"),
    "TestGenerationThreadDeath.test_inflight_request_does_not_hang_after_thread_crash": dict(
        outcome="xfail", raises=GuardianWouldNotStart, versions=("0.32.",),
        reason=CHANGED + "the guardian loads the model before its engine starts, as serve() "
        "does (a failed load exits with code 3), and answers or re-runs in-flight requests "
        "itself; the test calls stock's _await_response on a dead thread"),
}


def applies(entry: dict) -> bool:
    return any(STOCK_VERSION.startswith(prefix) for prefix in entry["versions"])


def expected_outcome(test_id: str):
    """The pytest mark for ``test_id`` on the installed mlx-lm, or None."""
    entry = EXPECTED.get(test_id)
    if entry is None or not applies(entry):
        return None
    if entry["outcome"] == "skip":
        return pytest.mark.skip(reason=entry["reason"])
    return pytest.mark.xfail(reason=entry["reason"], raises=entry.get("raises"), strict=True)


# --- fetching stock's tests -------------------------------------------------------------------
class StockTestsUnavailable(Exception):
    """The sdist could not be fetched; the message says why."""


def stock_test_file(version: str = STOCK_VERSION) -> Path:
    """``tests/test_server.py`` of mlx-lm ``version``, downloaded once and cached."""
    target = CACHE / version / "test_server.py"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(prefix="stock-sdist-") as download:
        sdist = download_sdist(version, Path(download))
        with tarfile.open(sdist) as archive:
            member = next((m for m in archive.getmembers() if m.name.endswith("/tests/test_server.py")), None)
            if member is None:
                raise StockTestsUnavailable(f"{sdist.name} has no tests/test_server.py")
            source = archive.extractfile(member).read()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written whole, then renamed: another run never reads half a file.
    partial = target.with_suffix(f".{os.getpid()}.part")
    partial.write_bytes(source)
    partial.replace(target)
    return target


def download_sdist(version: str, folder: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               "--disable-pip-version-check", "--timeout", str(PIP_TIMEOUT_S), "--retries", "1",
               "--dest", str(folder), f"mlx-lm=={version}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise StockTestsUnavailable(f"pip download of mlx-lm=={version} took over {DOWNLOAD_TIMEOUT_S}s")
    sdists = sorted(folder.glob("mlx_lm-*.tar.gz")) + sorted(folder.glob("mlx-lm-*.tar.gz"))
    if done.returncode != 0 or not sdists:
        last_lines = " | ".join((done.stderr or done.stdout).strip().splitlines()[-2:])
        raise StockTestsUnavailable(f"pip could not download the sdist of mlx-lm=={version} "
                                    f"(exit {done.returncode}): {last_lines}")
    return sdists[0]


# --- the fixture: what changes in stock's test module -----------------------------------------
_demo_model_path: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _demo_model(model_cache):
    """The session's demo model (tests/conftest.py), for stock's setUpClass to find."""
    from guardian.demo_model import ensure_demo_model

    _demo_model_path[:] = [Path(ensure_demo_model(model_cache))]
    yield


def demo_model_provider(with_draft=False, kv_bits=None, quantized_kv_start=0):
    """Stands in for stock's DummyModelProvider: the ModelProvider stock's
    ``main()`` builds for the demo model, with the dummy's options as flags."""
    model = str(_demo_model_path[0])
    argv = ["mlx_lm.server", "--model", model]
    if with_draft:
        argv += ["--draft-model", model]  # stock's fixture drafts with the model itself
    if kv_bits is not None:
        argv += ["--kv-bits", str(kv_bits), "--quantized-kv-start", str(quantized_kv_start)]
    built = []
    saved_argv = sys.argv
    sys.argv = argv
    try:
        stock.handler.run_stock_main(lambda host, port, provider: built.append(provider),
                                     add_arguments=lambda parser: None, after_parse=lambda namespace: None)
    finally:
        sys.argv = saved_argv
    provider = built[0]
    # The dummy serves its one model under "default_model" and "chat_model";
    # stock's ModelProvider maps names to paths in _model_map.
    provider._model_map["chat_model"] = model
    provider.load_default()
    return provider


def guardian_engine(model_provider, prompt_cache=None):
    """Stands in for stock's ``ResponseGenerator(model_provider, prompt_cache)``:
    the guardian as guardian.serving.assembly.serve checks, builds and starts it."""
    try:
        model_provider.load_default()
    except Exception as e:
        raise GuardianWouldNotStart(f"exit {EXIT_BOOT_ERROR}: the model did not load: {e!r}") from e
    problems = impossible_flags(model_provider.cli_args,
                                served_model_config(model_provider.model_key[0], model_provider.model))
    if problems:
        raise GuardianWouldNotStart(f"exit {EXIT_USAGE}: " + "; ".join(problems))
    config = load_config(None)
    pm = make_plugin_manager(config)
    # The exit codes the engine asks for (serve would exit with the first).
    exit_codes: list[int] = []
    served = StockFacingServedModel(model_provider, config, pm, on_exit=exit_codes.append)
    served.exit_codes = exit_codes
    served.start()
    if prompt_cache is not None:
        # The engine keeps its own cache (closed to probes); the cache a test
        # holds reads and writes the engine's.
        prompt_cache.__dict__ = served.engine.prompt_cache.__dict__
    return served


class StockFacingServedModel(ServedModel):
    """guardian.serving.assembly.ServedModel, with what stock's tests reach on a ResponseGenerator."""

    def __getattr__(self, name):
        # Only for names ServedModel lacks: stock's tests call ResponseGenerator
        # internals (_is_batchable, _make_state_machine, model_provider).
        engine = self.__dict__.get("engine")
        if engine is None:
            raise AttributeError(name)
        return getattr(engine, name)

    def stop_and_join(self):
        """Stop as serve() stops: the watchdog, the loop, then the shutdown hooks."""
        self.stall_detector.stop()
        self.engine.stop_and_join()
        self.pm.hook.guardian_shutdown(engine=self.engine, exit_code=0)


def guardian_handler(served, *args, **kwargs):
    """Stands in for stock's ``APIHandler(response_generator, ...)``."""
    return GuardianHandler(served, *args, system_fingerprint=stock.contract.get_system_fingerprint(), **kwargs)


def guardian_http_server(address, handler_factory):
    """Stands in for ``http.server.HTTPServer``: the guardian's server, with the fixture's handler."""
    httpd = make_http_server(*address, None)
    httpd.RequestHandlerClass = handler_factory
    return httpd


def load_stock_tests(path: Path) -> types.ModuleType:
    """Import stock's test_server.py under its own name, its fixture rebound to the guardian."""
    spec = importlib.util.spec_from_file_location(f"mlx_lm_{STOCK_VERSION.replace('.', '_')}_test_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.DummyModelProvider = demo_model_provider
    module.ResponseGenerator = guardian_engine
    module.APIHandler = guardian_handler
    # Only this module's "http" changes; its HTTPServer is the guardian's.
    module.http = types.SimpleNamespace(**{**vars(http), "server": types.SimpleNamespace(
        **{**vars(http.server), "HTTPServer": guardian_http_server})})
    return module


def stock_test_cases(module: types.ModuleType) -> dict[str, type]:
    """Stock's TestCase classes, each test marked with its expected outcome."""
    cases = {}
    for name, value in vars(module).items():
        if isinstance(value, type) and issubclass(value, unittest.TestCase) and value.__module__ == module.__name__:
            for test_name in unittest.TestLoader().getTestCaseNames(value):
                mark = expected_outcome(f"{name}.{test_name}")
                if mark is not None:
                    setattr(value, test_name, mark(getattr(value, test_name)))
            cases[name] = value
    return cases


try:
    STOCK_TESTS = load_stock_tests(stock_test_file())
except StockTestsUnavailable as e:
    pytest.skip(f"stock's tests/test_server.py is unavailable: {e}", allow_module_level=True)

# pytest collects the TestCase classes it finds here: each stock test is an item.
STOCK_CASES = stock_test_cases(STOCK_TESTS)
globals().update(STOCK_CASES)


# --- the list's own checks --------------------------------------------------------------------
def stock_test_ids() -> set[str]:
    return {f"{name}.{test}" for name, case in STOCK_CASES.items()
            for test in unittest.TestLoader().getTestCaseNames(case)}


def test_every_expected_outcome_names_a_stock_test():
    """An entry for this version that no stock test matches is stale."""
    ids = stock_test_ids()
    stale = [test_id for test_id, entry in EXPECTED.items() if applies(entry) and test_id not in ids]
    assert not stale


def test_docs_list_every_expected_outcome():
    """docs/development.md's "Stock's own tests" section has one line per entry, with its reason."""
    page = (REPO / "docs" / "development.md").read_text()
    section = re.search(r"^## Stock's own tests\n(.*?)(?=^## |\Z)", page, re.S | re.M)
    assert section, "docs/development.md has no \"## Stock's own tests\" section"
    missing = [test_id for test_id in EXPECTED if f"`{test_id}`" not in section.group(1)]
    assert not missing


def test_an_unreachable_index_is_a_reason_to_skip(tmp_path, monkeypatch):
    """Without the package index, fetching raises what the module skips with, and soon."""
    closed = "http://127.0.0.1:9/simple"  # the discard port: nothing listens there
    for name, value in {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": closed,
                        "PIP_EXTRA_INDEX_URL": closed, "PIP_FIND_LINKS": "", "PIP_NO_CACHE_DIR": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(StockTestsUnavailable, match=f"pip could not download the sdist of mlx-lm=={re.escape(STOCK_VERSION)}"):
        download_sdist(STOCK_VERSION, tmp_path)
