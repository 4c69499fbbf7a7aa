"""Reducing gradients across ranks: the allreduce callback, its buckets and steps, the choice
of a step's path (gradmgr's buckets, the backend's reducer, after the backward), ``no_sync``.

Nothing is imported here: the public names are :mod:`gradmgr.distributed`'s."""
