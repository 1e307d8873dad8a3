"""Multi-process execution: master and workers over gRPC (torch.distributed inside a
tensor-parallel replica, later).

    cluster.proto        the protocol, field by field (`make proto` regenerates *_pb2*.py)
    wire.py              SchedulerOutput / ModelRunnerOutput <-> protobuf, exact round trip
    layout.py            ClusterLayout (nnodes, dp_size, tp_size, ep_size), ClusterOptions,
                         the model fingerprint, the torch.distributed backend per device
    security.py          cluster token (server interceptor), session metadata, TLS
    coordinator.py       the master's Register service (refusals name what differs)
    health.py            the master's health checks of its workers
    master.py            node 0's start-up: wait for workers, build the replicas
    worker_node.py       nodes 1..N-1: Worker service, registration, master watchdog
    parallel.py          this rank's place inside its replica (tensor parallelism)
"""
