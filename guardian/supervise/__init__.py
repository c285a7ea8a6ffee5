"""Subprocess mode: a supervisor that owns the public port and runs the engine as a child.

Imports neither mlx nor mlx_lm (tests/test_layout.py reads that from the code).
"""
