"""Kernels of our own, built for the machine they run on (``cpu``: C compiled at first use)."""
