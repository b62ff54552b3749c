"""The refit runtime (executes a plan on torch.distributed). Not built yet.

Nothing here pretends to work: see the project's issues for the runtime.
"""
