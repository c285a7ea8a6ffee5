"""Configuration: every setting declared once, the TOML file, and its live version.

``registry``: setting types, ``Setting`` and ``Table`` (each setting declared
once); ``tables``: the core's tables; ``loading``: the file read and checked;
``live``: the file followed while serving (saves, SIGHUP); ``reference``: the
example file written from the declarations
(``python -m guardian.config.reference > config/guardian.example.toml``).
Imports no mlx: the supervisor reads its configuration here too.
"""
