"""Engine core: requests, scheduler, output processing."""
