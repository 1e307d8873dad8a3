"""The worker side: model runner, sampler, cache allocation."""
