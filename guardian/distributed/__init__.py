"""mlx-guardian as the program ``mlx.launch`` starts: a group of ranks serving one model.

Only rank 0 serves HTTP; every rank runs stock's loop, supervised, and
stock's own request broadcast carries each request to the others. Ranks
cannot restart their loops apart (the others would wait in a collective for
ever), so a failure, stall or loss of any rank ends the whole group with
exit code 7 (rank 0 answers its clients 503 + Retry-After first, or under
``--supervise`` leaves them to the supervisor to send again), and the
launcher's caller, or ``mlx-guardian --supervise --launch-args``, starts it
again. ``launch`` (the supervisor's side) imports no mlx, nor does this
package's ``__init__``: the supervisor carries none (tests/test_layout.py).
"""
