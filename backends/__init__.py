"""Checkpoint format strategies and checkpoint engines, each in a module of its own."""
