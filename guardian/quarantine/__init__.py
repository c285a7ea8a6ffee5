"""Requests refused at the door for a while because they failed the engine.

``table``: the one expiring table (fingerprint -> until when, and why) and the
refusal a client gets; ``blamed``: the engine's use (a request that failed the
engine alone); ``crashes``: the supervisor's use (a request in flight at two
crashes of the engine process); ``isolation``: a suspect relayed alone.
Imports no mlx: the supervisor carries this package.
"""
