"""Deltas: a version encoded against a base a subscriber holds (sparse or XOR+zstd), and served."""
