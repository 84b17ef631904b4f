"""Tensor parallelism: the ranks of one model, and how its weights and work split over them."""
