"""Worker programs for the multi-process tests (run as ``python -m dist_workers.run``)."""
