"""A pygments lexer for `.layout` files (``pygmentize -l layout FILE``).

Registered as the entry point ``pygments.lexers: layout``; used by the HTML
plan report and by ``layoutc fmt --diff`` on a terminal.
"""

from __future__ import annotations

from pygments.lexer import RegexLexer, bygroups, include, words
from pygments.token import Comment, Keyword, Name, Number, Operator, Punctuation, String, Text, Whitespace

from .vocabulary import DTYPES, FUNCTIONS, KEYWORDS

# `tensor` and `local` have rules of their own: `tensor` opens a tensor name,
# `local` is a keyword only after `NAME.`.
_PLAIN_KEYWORDS = tuple(k for k in KEYWORDS if k not in ("tensor", "local"))


class LayoutLexer(RegexLexer):
    """Keywords, dtypes, tensor names with `{EXPR}` interpolations, expressions."""

    name = "layout"
    aliases = ["layout", "layoutlang"]
    filenames = ["*.layout"]
    mimetypes = ["text/x-layout"]

    tokens = {
        "root": [
            (r"\s+", Whitespace),
            (r"#.*?$", Comment.Single),
            (r"(tensor)(\s+)", bygroups(Keyword.Declaration, Whitespace), "tensorname"),
            (r"(as)(\s+)", bygroups(Keyword, Whitespace), "tensorname"),
            (r"(mesh)(\s+)([A-Za-z_]\w*)", bygroups(Keyword.Declaration, Whitespace, Name.Namespace)),
            (r"(arg|const)\b", Keyword.Declaration),
            include("expr"),
        ],
        "expr": [
            (r"\s+", Whitespace),
            (r"#.*?$", Comment.Single),
            (r'"[^"\n]*"', String),
            (words(_PLAIN_KEYWORDS, suffix=r"\b"), Keyword),
            (words(DTYPES, suffix=r"\b"), Keyword.Type),
            (words(tuple(FUNCTIONS), suffix=r"\b"), Name.Builtin),
            (r"([A-Za-z_]\w*)(\.)(local)\b", bygroups(Name.Variable, Punctuation, Keyword.Pseudo)),
            (r"([A-Za-z_]\w*)(\s*)(:)", bygroups(Name.Label, Whitespace, Punctuation)),
            (r"[A-Za-z_]\w*", Name),
            (r"[0-9](?:_?[0-9])*", Number.Integer),
            (r"\.\.|//|[-+*/%=|]", Operator),
            (r"[()\[\]{},]", Punctuation),
            (r".", Text),
        ],
        "tensorname": [
            (r"\{", String.Interpol, "interp"),
            (r"[A-Za-z0-9_.]+", Name.Variable),
            (r"", Text, "#pop"),
        ],
        "interp": [
            (r"\}", String.Interpol, "#pop"),
            include("expr"),
        ],
    }
