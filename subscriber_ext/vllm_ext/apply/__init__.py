"""How tensors reach vLLM parameters: names, shapes, in place, reload, prepared swaps."""
