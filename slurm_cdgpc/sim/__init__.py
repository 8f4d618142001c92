"""Trace-driven cluster simulation: job traces in, policies replayed against simulated GPUs."""
