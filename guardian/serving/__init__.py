"""Serving one model over HTTP: assembly, the handler and its endpoints, the connection layer.

``assembly``: ``serve`` (load, start, drain, exit) and ``ServedModel`` (one served
model's engine, admission and stall detection, wired); ``follower``: a rank of an
mlx.launch group other than 0; ``handler``: stock's APIHandler, answering faults
properly; ``endpoints``: the health, readiness, status, metrics and models
endpoints; ``connection``: requests read under deadlines before a handler thread
sees them; ``open_files``: the process's open-files limit.
"""
