"""The sync client: the protocol state machine and its parts."""
