"""Serving: the ROUTER/PUB thread, per-peer credit, the peer tracker, fleet reports, relays."""
