"""Checkpoint engines: bucketed weight transfers from trainer to rollout."""
