"""What `state` holds and how each rank captures and restores it: entry kinds, random streams,
replayed samplers, validation before any change, and undo of a failed restore."""
