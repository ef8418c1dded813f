"""Adapters that plug this library into other frameworks (verl). Each module imports its framework lazily."""
