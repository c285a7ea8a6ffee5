"""mlx-guardian as the program ``mlx.launch`` starts: a group of ranks serving one model.

Only rank 0 serves HTTP; every rank runs stock's loop, supervised, and
stock's own request broadcast carries each request to the others. Ranks
cannot restart their loops apart (the others would wait in a collective for
ever), so a failure, stall or loss of any rank ends the whole group with
exit code 7 (rank 0 answers its clients 503 + Retry-After first, or under
``--supervise`` leaves them to the supervisor to send again), and the
launcher's caller, or ``mlx-guardian --supervise --launch-args``, starts it
again.
Nothing in this package but ``group`` and ``rendezvous`` imports mlx, so
the supervisor can use ``launch``.
"""
