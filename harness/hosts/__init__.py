"""Hosts of a run: which host each server is on and the address it binds (placement.py), and network namespaces that
stand for hosts on one machine (netns.py)."""
