"""Servers, clusters and GPUs: topology files (schema 1, and 2 as tiers), the routes derived from
them, clusters of servers, probed topologies, per-GPU kernel tables."""
