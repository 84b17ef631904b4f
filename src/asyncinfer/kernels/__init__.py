"""Kernels of our own: ``cpu``, C built for the machine it runs on (compiled at first use);
``triton_invariant``, the batch-invariant mode's Triton kernels for CUDA."""
