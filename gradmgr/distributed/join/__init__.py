"""Uneven inputs: the manager ``data_parallel`` returns as a joinable of the framework's
context (torch's ``Join``), and a joined rank's part of the others' steps.

Nothing is imported here: the public names are :mod:`gradmgr.distributed`'s."""
