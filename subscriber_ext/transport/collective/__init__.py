"""A node's side of the collective (gloo/NCCL) path."""
