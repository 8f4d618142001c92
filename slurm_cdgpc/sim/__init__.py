"""Trace-driven cluster simulation: job traces in, policies replayed against simulated GPUs.

Policies see what a live head would measure, never the plant (the oracle aside). Design:
DESIGN.md, "Simulator".
"""
