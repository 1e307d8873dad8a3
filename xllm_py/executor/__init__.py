"""The boundary between the engine core and the workers (in-process now, gRPC later)."""
