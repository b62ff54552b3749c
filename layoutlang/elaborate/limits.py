"""How much input elaboration takes: every bound of the front end, in one place.

Each limit turns hostile or runaway input (a device named as a file, a chain of
includes, a generated file of millions of lines) into a positioned diagnostic
within seconds instead of a hang, a MemoryError or a RecursionError
(docs/language.md, "Choices where the spec is silent"). Passes read them as
`limits.NAME` when they check, so a test may lower one with monkeypatch.
"""

INT64_MAX = (1 << 63) - 1    # every value, extent and byte size fits in a signed 64-bit integer
MAX_RANKS = 1 << 20          # ranks of one layout (a mesh's offset + size)
MAX_TENSORS = 1 << 20        # tensor instances per layout; also `tensor` statements, counted before parsing
MAX_KEYS = 1 << 20           # keys held inside stored tensors (v2 regions), per layout
MAX_INCLUDE_DEPTH = 64       # nested includes below the top-level file
MAX_FILE_BYTES = 64 << 20    # per file read; 1<<20 tensor lines of 64 bytes fit
