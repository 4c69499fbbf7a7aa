"""The errors data parallelism raises."""

from __future__ import annotations

from typing import Any, Sequence


class RankMismatchError(RuntimeError):
    """The ranks planned different tensors for one allreduce callback (or
    :func:`data_parallel` was given modules that differ); raised on every rank, naming the
    first difference.

    It takes two ranks that differ to raise it (the message names, for instance,
    ``fc2.weight`` with its dtype and shape on this rank); the guide "Data parallel"
    (docs/data-parallel.md) says where each check runs.

    Example:
        Every rank raises it at the same call, so a script can stop every rank cleanly:

        >>> from gradmgr.distributed import RankMismatchError
        >>> issubclass(RankMismatchError, RuntimeError)
        True
    """


class RankFailedError(RuntimeError):
    """Another rank's backward raised during this data-parallel step (or its recording ended
    without one: a skipped batch): the step's reduced gradients are incomplete, so no rank
    uses them (``.grad`` keeps what it held before).

    Every rank can then skip the step together: catch it, and the rank's own error, around
    ``with gm:``, call ``opt.zero_grad()`` and go on to the next batch (the guide "Data
    parallel", docs/data-parallel.md, shows the loop).

    Example:
        Here a process group of one rank whose batch fails; on the other ranks the same
        ``except`` catches ``RankFailedError``, and every rank skips the step:

        >>> import torch
        >>> import torch.distributed as dist
        >>> from gradmgr.distributed import data_parallel, free_port
        >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
        ...                         rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1)
        >>> gm = data_parallel(model)
        >>> try:
        ...     with gm:
        ...         raise ValueError("a bad batch")
        ... except (RankFailedError, ValueError):
        ...     print("every rank skips this step")
        every rank skips this step
        >>> model.weight.grad is None
        True
        >>> del gm
        >>> dist.destroy_process_group()
    """


class RanksOutOfStepError(RankMismatchError):
    """Not every rank started this data-parallel step: this rank waited, at the start of its
    step, for the others' plan check until the process group's patience ran out, or a rank
    left the group meanwhile. The ranks ran different numbers of steps: a rank skipped a
    batch (``continue``) or ran out of data while the others trained on; or another rank waits
    in a collective this one never called (torch: ``if rank == 0: dcp.save(...)``, DCP's
    save being a collective of every rank).

    Collectives pair by their order alone, so without it the rank with a step more meets
    whatever the others do after their loop (an evaluation's allreduce, a barrier) and
    crashes inside the transport or hangs. gradmgr checks the plans in a process group of its
    own, which meets only gradmgr's checks, and gives up after half the group's timeout (a
    minute short of the timeout, for timeouts over two minutes), while the others still wait
    in their next collective: that collective then meets this rank's next one, and the group
    is still usable for a program that catches the error. The ranks that finished their loop
    are not told: the error stops the job on the rank that can know. The remedy is ``with
    Join([gm]):`` (the guide "Uneven inputs") or a step on every rank (``with gm:
    gm.backward()`` records an empty one); under full sharding (``shard="full"``), which has
    no ``Join`` and checks every recording, the same number of batches on every rank. After
    the error, start a new process group.

    Example:
        >>> from gradmgr.distributed import RanksOutOfStepError
        >>> from gradmgr.distributed import RankMismatchError
        >>> issubclass(RanksOutOfStepError, RankMismatchError)  # the ranks disagree on steps
        True
    """


class SparseGradientError(TypeError):
    """The allreduce callback reduces dense gradients only; a tensor got a sparse one.

    Example:
        Here a process group of one rank (``Embedding(100, 8)``, dense, is reduced):

        >>> import torch
        >>> import torch.distributed as dist
        >>> from gradmgr.distributed import data_parallel, free_port
        >>> dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
        ...                         rank=0, world_size=1)
        >>> emb = torch.nn.Embedding(100, 8, sparse=True)
        >>> gm = data_parallel(emb)
        >>> try:
        ...     with gm:
        ...         gm.backward(emb(torch.tensor([1, 2])).sum())
        ... except SparseGradientError:
        ...     print("refused")
        refused
        >>> del gm
        >>> dist.destroy_process_group()
    """


def sparse_error(ops: Any, tensor: Any) -> SparseGradientError:
    """The refusal of ``tensor``'s sparse gradient, in the words of ``ops``'s framework."""
    return SparseGradientError(sparse_message(ops.shape(tensor), ops.idioms().wrapper))


def sparse_message(shape: Sequence[int], wrapper: str = "DDP") -> str:
    """``wrapper``: the framework's data-parallel wrapper, as its users name it."""
    return (f"the allreduce callback reduces dense gradients only, and a tensor of shape "
            f"{list(shape)} got a sparse one (nn.Embedding(sparse=True) or "
            f"F.embedding(..., sparse=True)?): make it dense (sparse=False), or reduce that "
            f"tensor with {wrapper}, which handles sparse gradients")
