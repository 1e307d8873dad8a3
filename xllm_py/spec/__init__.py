"""Speculative decoding with the MTP draft (arrives with the MTP issue)."""
