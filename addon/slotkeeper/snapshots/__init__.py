"""KV snapshots: safe file names, the slot folder and its checks, the save/verify/restore
pipeline, saves with their claim marks, and seeds."""
