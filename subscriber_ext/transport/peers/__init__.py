"""Peer sharing: serving verified chunks to peers and fetching from them."""
