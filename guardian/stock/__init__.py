"""Stock mlx_lm, embedded: the one package that touches its private or internal names.

``contract``: the seams the guardian relies on, checked at import (and by
tests/test_stock_contract.py); ``loop``: the generation loop's thread, its steps
observed; ``sampling``: a request's sampler and logits processors, failing that
request alone; ``continuation``: a request continued after the tokens its client
has, and a failed batch's KV kept; ``requests``: a request's tokens and
fingerprint carried on stock's own objects; ``models``: loading and listing
models; ``handler``: stock's HTTP handler and ``main()``.
"""

# The contract first: it imports mlx_lm with the open-files limit guarded
# (guardian.stock.import_guard), before any other module imports mlx_lm.
from guardian.stock import contract  # noqa: F401  (isort: skip)
from guardian.stock import continuation, handler, loop, models, requests, sampling  # noqa: F401
