"""What a replica shows the outside: per-rank status files and Prometheus metrics."""
