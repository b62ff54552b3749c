"""Presentation of layouts and plans: reports people read, never planning.

Every module here only reads the compiler's public model (`Plan.transfers`,
`Plan.templates`, `Plan.picks`, `Plan.template_of`, `Plan.ops`, ...) and decides
nothing; the compiler never imports this package (tests/test_architecture.py).

- render.py: the plan as JSON (the LANGUAGE.md 6 contract), a text report, DOT.
- html_page.py: the self-contained HTML report (`render_html`), built from
  html_analysis.py (what the plan says) and html_svg.py (where it is drawn).
- explain.py: one tensor as a terminal picture (`layoutc explain`).
- units.py: bytes, rank lists, counts and slices as people read them.
- templates/: the jinja2 templates (package data).
"""
