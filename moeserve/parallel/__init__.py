"""One model across devices and nodes over torch.distributed (docs/parallel.md).

    layout.py    which shard a rank holds (torch-free): the split checked against the model
    comm.py      the model's collectives (all-reduce, all-gather) a sharded layer calls
    group.py     joining the world: the NCCL / gloo model group, the gloo control group
    executor.py  rank 0: start node 0's workers, mirror every runner call on all ranks
    worker.py    a worker rank: its call loop (python -m moeserve.parallel.worker)
    node.py      a node without the engine core: --headless, torchrun's ranks > 0
    watchdog.py  heartbeats and the step deadline that names a failed rank
    env.py       the rendezvous variables and the NVLink multicast guard
"""
