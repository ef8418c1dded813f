"""A package from outside the project: one checkpoint format and one checkpoint engine.

It uses only the public contracts (`backends.base.FormatBackend`,
`backends.engines.CheckpointEngine`) and is reached by entry point or by decorator, never by
an edit to the project.
"""
