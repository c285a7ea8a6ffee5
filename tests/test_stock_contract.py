"""The seams into stock mlx_lm still exist in the installed mlx-lm.

If one of these fails after an mlx-lm upgrade, the message names the seam;
guardian/stock/ is the only package to change.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import mlx_lm.server as server
import pytest

from guardian import stock

REPO = Path(__file__).resolve().parent.parent


def test_installed_mlx_lm_has_every_seam():
    missing = stock.contract.missing_names()
    assert not missing, (
        f"mlx-lm {stock.contract.STOCK_VERSION} changed: it lacks {missing}; "
        "update guardian/stock/"
    )


def test_installed_mlx_lm_is_a_tested_version():
    assert stock.contract.STOCK_VERSION in stock.contract.TESTED_VERSIONS, (
        f"mlx-lm {stock.contract.STOCK_VERSION} has not been tested with mlx-guardian "
        f"(tested: {stock.contract.TESTED_VERSIONS}); run the suite and add it to TESTED_VERSIONS"
    )


def test_a_moved_seam_is_named_at_start(monkeypatch):
    monkeypatch.delattr(server.ResponseGenerator, "_tokenize")
    with pytest.raises(stock.contract.StockChanged, match=r"mlx_lm\.server\.ResponseGenerator\._tokenize"):
        stock.contract.check_stock()


def test_a_seam_outside_the_server_module_is_named_at_start(monkeypatch):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    monkeypatch.setattr(TokenizerWrapper, "detokenizer", None)
    with pytest.raises(stock.contract.StockChanged, match=r"mlx_lm\.tokenizer_utils\.TokenizerWrapper\.detokenizer"):
        stock.contract.check_stock()


def test_generation_loop_is_still_a_method_the_thread_runs():
    # 0.31 runs Thread(target=self._generate); 0.32 _run_generate calls it.
    import inspect

    source = inspect.getsource(server.ResponseGenerator.__init__)
    assert "_generate" in source, "stock no longer starts its thread on _generate"


def test_instance_attributes_stock_sets_are_still_set():
    import inspect

    source = inspect.getsource(server.ResponseGenerator.__init__)
    for name in stock.contract.INSTANCE_ATTRIBUTES:
        assert f"self.{name} =" in source, f"stock ResponseGenerator no longer sets self.{name}"


def test_the_loop_looks_up_what_the_guardian_swaps():
    import inspect

    loop = inspect.getsource(server.ResponseGenerator._generate)
    assert "BatchGenerator(" in loop, "stock's loop no longer builds BatchGenerator by name"
    single = inspect.getsource(server.ResponseGenerator._serve_single)
    assert "stream_generate(" in single, "stock's sequential path no longer calls stream_generate"
    for path, source in (("loop", loop), ("sequential path", single)):
        for factory in ("_make_sampler(args", "_make_logits_processors(args)"):
            assert factory in source, f"stock's {path} no longer builds a request's sampling with {factory}"


def test_the_loop_decodes_in_runs_the_guardian_can_end():
    import inspect

    loop = inspect.getsource(server.ResponseGenerator._generate)
    assert "for _ in self._time_budget:" in loop, "stock's loop no longer decodes in TimeBudget runs"
    budget = inspect.getsource(server.TimeBudget)
    assert "self._is_distributed =" in budget, "stock's TimeBudget no longer says whether it is distributed"
    assert "def __next__(self):" in budget, "stock's TimeBudget is no longer an iterator"


def _private_mlx_lm_uses(path: Path) -> list[str]:
    """Imports of mlx_lm.server and private names taken from mlx_lm modules."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm"):
            if node.module == "mlx_lm.server":
                found.append("from mlx_lm.server import ...")
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "mlx_lm.server"]
    return found


def test_only_the_stock_package_touches_mlx_lm_server_or_private_names():
    offenders = {}
    for path in REPO.glob("guardian/**/*.py"):
        if path.parent == REPO / "guardian" / "stock":
            continue
        uses = _private_mlx_lm_uses(path)
        if uses:
            offenders[str(path.relative_to(REPO))] = uses
    assert not offenders, f"private mlx_lm names outside guardian/stock/: {offenders}"


def test_sampling_kind_names_what_stocks_arguments_turn_on():
    """The watchdog's new-kind rule reads stock's argument dataclasses by field
    name: a renamed field would silently drop out of every kind."""
    _, greedy = stock.requests.make_request("hi", max_tokens=4, cli_args=SimpleNamespace(num_draft_tokens=3))
    assert stock.sampling.sampling_kind(greedy) == ()
    sampled = dataclasses.replace(
        greedy,
        sampling=dataclasses.replace(greedy.sampling, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05,
                                     xtc_probability=0.1),
        logits=dataclasses.replace(greedy.logits, logit_bias={5: 1.0}, repetition_penalty=1.2,
                                   presence_penalty=0.5, frequency_penalty=0.5),
        logprobs=True,
    )
    assert stock.sampling.sampling_kind(sampled) == ("temperature", "top_p", "top_k", "min_p", "xtc", "logit_bias",
                                                     "repetition_penalty", "presence_penalty", "frequency_penalty",
                                                     "logprobs")


# -- the continuation path: a failed batch's KV (guardian.engine.kept_kv) ----------

def _greedy_tokens(batch, uids: list[int], limit: int) -> dict[int, list[int]]:
    """Step ``batch`` until each of ``uids`` produced ``limit`` tokens or finished."""
    produced = {uid: [] for uid in uids}
    finished: set[int] = set()
    for _ in range(10 * limit + 20):  # prefill steps and all: bounded
        if all(uid in finished or len(produced[uid]) >= limit for uid in uids):
            break
        for response in batch.next()[1]:
            produced[response.uid].append(response.token)
            if response.finish_reason is not None:
                finished.add(response.uid)
    return produced


def test_a_failed_batchs_kv_goes_on_as_the_batch_would_have(model_cache):
    """What the guardian keeps of a failed batch: ``BatchGenerator.extract_cache``
    gives each request's KV with the tokens it holds (its prompt, then each token
    its steps produced), and a new batch started from that KV, cut to leave the
    prompt's last token (``LRUPromptCache.fetch_nearest_cache``'s convention), goes
    on with the very greedy tokens the first batch would have produced. If this
    fails, mlx-lm changed what a batch's KV holds: see guardian/stock/continuation.py's
    ``rows_of_completed_steps``."""
    from mlx_lm import load

    from guardian.demo_model import ensure_demo_model

    model, tokenizer = load(str(ensure_demo_model(model_cache)))
    batch_class = stock.loop.step_observed(stock.contract.STOCK_BATCH_GENERATOR, observe=lambda: None)
    prompts = [tokenizer.encode("Once upon a time"), tokenizer.encode("The quick brown fox jumps over the")]
    total, before_failure = 24, 9

    def run(limit: int):
        batch = batch_class(model)
        uids = batch.insert_segments([[prompt] for prompt in prompts], max_tokens=[total] * len(prompts))
        return batch, uids, _greedy_tokens(batch, uids, limit)

    _, uids, unfailed = run(total)
    batch, uids, produced = run(before_failure)
    rows = stock.continuation.rows_of_completed_steps(batch)
    assert rows is not None and len(rows) == len(prompts)
    for prompt, uid in zip(prompts, uids):
        continued_prompt = prompt + produced[uid]
        [(held, cache)] = [(tokens, cache) for tokens, cache in rows if tokens[: len(prompt)] == prompt]
        assert held == continued_prompt, "a batch's KV no longer holds the prompt and the tokens produced"
        reused = stock.continuation.reusable_length(continued_prompt, held, cache)
        assert reused == len(continued_prompt) - 1
        cache = stock.continuation.cut_cache(cache, len(held), reused)
        again = batch_class(model)
        [new_uid] = again.insert_segments([[continued_prompt[reused:]]], max_tokens=[total - len(produced[uid])],
                                          caches=[cache], all_tokens=[continued_prompt[:reused]])
        rest = _greedy_tokens(again, [new_uid], total)[new_uid]
        assert produced[uid] + rest == unfailed[uid]


def test_a_batch_whose_step_raised_half_way_offers_no_kv(model_cache):
    """A fault before a step (the guardian's step hook) leaves the last step's KV;
    one inside stock's step may have written it half way: nothing is offered."""
    from mlx_lm import load

    from guardian.demo_model import ensure_demo_model

    model, tokenizer = load(str(ensure_demo_model(model_cache)))
    planted = {"before": False, "inside": False}

    def observe():
        if planted["before"]:
            raise RuntimeError("planted before the step")

    class FailingInside(stock.contract.STOCK_BATCH_GENERATOR):
        def next(self):
            if planted["inside"]:
                raise RuntimeError("planted inside the step")
            return super().next()

    batch = stock.loop.step_observed(FailingInside, observe=observe)(model)
    [uid] = batch.insert_segments([[tokenizer.encode("Once upon a time")]], max_tokens=[20])
    _greedy_tokens(batch, [uid], 3)
    planted["before"] = True
    with pytest.raises(RuntimeError, match="before"):
        batch.next()
    assert stock.continuation.rows_of_completed_steps(batch)
    planted.update(before=False, inside=True)
    with pytest.raises(RuntimeError, match="inside"):
        batch.next()
    assert stock.continuation.rows_of_completed_steps(batch) is None


def test_mlx_launch_still_has_what_the_group_launcher_replaces():
    """guardian.distributed.shim runs mlx.launch's ``main()`` itself, with the module's
    ``select`` replaced (its busy waits); where these names moved it execs mlx.launch as
    it is, busy waits and all."""
    import select

    from mlx._distributed_utils import launch

    assert launch.select is select.select and callable(launch.main), (
        "mlx changed mlx._distributed_utils.launch: update guardian/distributed/shim.py")
