"""One staging per node: the owner rank stages, the other local ranks map it."""
