"""What an operator sees: logs, metrics and counting.

``logs``: structlog JSON lines, mlx_lm's own records in the same shape;
``metrics``: one Prometheus registry per server, its exposition, ``gauge()``;
``counting``: events in a window, things under way. Imports no mlx: the
supervisor uses it too.
"""
