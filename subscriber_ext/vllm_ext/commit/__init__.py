"""When every rank switches: the coordinator, the strategies, the engine driver, vLLM patches."""
