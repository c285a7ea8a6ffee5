"""mlx-guardian: stock mlx_lm.server that survives a dying or stuck engine."""

from guardian.engine_view import EngineView
from guardian.errors import GuardianError
from guardian.hookspecs import hookimpl

# What a plugin needs: the marker for its hooks, the engine as hooks see it, the error to refuse with.
__all__ = ["EngineView", "GuardianError", "hookimpl"]
__version__ = "0.1.0"
