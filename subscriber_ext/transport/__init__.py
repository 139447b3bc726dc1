"""Transport client: subscribe, fetch chunks with credit, verify, stage whole versions."""
