"""The plan compiler (IR pair -> verified transfer plan). Not built yet.

Nothing here pretends to work: see the project's issues for the plan compiler.
"""
