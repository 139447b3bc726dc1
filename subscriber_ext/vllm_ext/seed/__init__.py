"""The seed API's parts: the broadcast communicator, its trainer side, tensors as bytes."""
