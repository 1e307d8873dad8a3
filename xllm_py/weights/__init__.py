"""Checkpoint reading: safetensors files, name checks, (later) FP8 and TP slicing."""
