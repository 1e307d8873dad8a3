"""Multi-process execution over gRPC and torch.distributed (arrives with the cluster issue)."""
