"""A version while it arrives: assemblies, deltas, budget, requests in flight, progress."""
