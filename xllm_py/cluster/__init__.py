"""What runs the processes of a multi-node deployment: master and workers over gRPC,
torch.distributed inside each tensor-parallel replica. It sits above the engine (the
master builds the engine core over these executors); models never import it.

    cluster.proto        the protocol, field by field (`make proto` regenerates *_pb2*.py)
    wire.py              SchedulerOutput / ModelRunnerOutput <-> protobuf, exact round trip
    layout.py            ClusterLayout (nnodes, dp_size, tp_size, ep_size), ClusterOptions,
                         the model fingerprint, the torch.distributed backend per device,
                         joining and aborting the process groups
    security.py          cluster token (server interceptor), session metadata, TLS
    coordinator.py       the master's Register service (refusals name what differs)
    health.py            the master's health checks of its workers
    grpc_executor.py     the executors of remote ranks (the engine's `Executor` interface)
    master.py            node 0's start-up: wait for workers, build the replicas
    worker_node.py       nodes 1..N-1: Worker service, registration, master watchdog
    ray_launch.py        `--launcher=ray`: one node process per Ray placement-group bundle
    ports.py             free ports from below the kernel's ephemeral range
"""
