"""mlx-guardian: stock mlx_lm.server that survives a dying or stuck engine."""

from guardian.hookspecs import hookimpl

__all__ = ["hookimpl"]
__version__ = "0.1.0"
