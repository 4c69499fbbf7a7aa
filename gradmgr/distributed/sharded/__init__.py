"""ZeRO-2: reduce-scattered gradient shards, ``ShardedOptimizer`` stepping this rank's
segments, the parameters gathered back, its checkpoints and its part in uneven inputs.

Nothing is imported here: the public names are :mod:`gradmgr.distributed`'s."""
