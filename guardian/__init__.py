"""mlx-guardian: stock mlx_lm.server that survives a dying or stuck engine."""

from guardian.config.registry import ConfigError
from guardian.engine_view import EngineView
from guardian.errors import GuardianError
from guardian.hookspecs import hookimpl

# What a plugin needs: the marker for its hooks, the engine as hooks see it, the error to
# refuse a request with, the one to refuse its settings with. (A request on its way in,
# guardian.admission.facts.Admission, is only handed to hooks: importing it loads mlx.)
__all__ = ["ConfigError", "EngineView", "GuardianError", "hookimpl"]
__version__ = "0.1.0"
