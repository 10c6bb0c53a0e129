"""Triton kernels of ringlse, installed as `ringlse.kernels` (never as a top-level `kernels`).

Modules import Triton; `ringlse` imports them lazily, so this package is only loaded when a kernel is used.
"""
