"""Triton kernels of ringlse, installed as `ringlse.kernels` (never as a top-level `kernels`).

Kernel modules import Triton (`host` and `parts` do not); `ringlse` imports them lazily, so this package is only
loaded when a kernel is used. Kernels take plain tensors and integers and never import the package above them.
"""
