"""The LSE toolkit's Triton kernels: `softmax/` (softmax, log_softmax, logsumexp), `log_bmm.py`, and
what only they use: `launch.py` (their launcher), `occupancy.py` (the cooperative kernels' programs
per SM), `active_config.py` (their measured constants' override).

Imported only by `ringlse.lse`, on first use; they take `ringlse.kernels.host`'s helpers (shared with
the attention kernels, one copy) and never import the package above them.
"""
