"""AST -> IR: elaboration, one pass per question.

A layout's statements are elaborated in order; each module answers one
question and says in its docstring what it guarantees:

    driver    in which order: the statement table and a tensor's steps, as data;
              the public doors `load` and `loads`
    sources   which texts make the layout: bounded file reads, includes, the
              statement count before parsing, the digest
    scope     what a name means and which integer an expression denotes
    loops     which iterations run, and which `over` coordinate owns each
    meshes    which ranks exist, which mesh a tensor is on, which axes it claims
    dims      what each dim is: AST mode -> IR mode, `over` and `chunk` checked
    names     what an instance is called; keys and names unique
    keys      which keys a stored tensor holds (v2: part keys, stacked dims,
              `transposed`) and the logical box of each
    limits    how much input is taken

Every user error is an `ElaborationError` at the offending span, with a fix
hint where one is known.

>>> loads("mesh m (tp=2)\\ntensor w [8 over tp, 4]").tensors[0].local_shape
(4, 4)
"""

from .driver import load, loads
from .sources import FileRefused, read_layout_file, read_source

__all__ = ["load", "loads", "read_source", "read_layout_file", "FileRefused"]
