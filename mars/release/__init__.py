"""Release phase: export of the block forward, the artifact store, promote and pull."""
