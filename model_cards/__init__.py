"""dpbert's model card templates (Jinja2), installed with dpbert as the package `dpbert.model_cards`.

This folder sits at the top of the repository (see README.md here for the card's privacy contract);
pyproject.toml maps it to `dpbert.model_cards`, so a wheel carries the templates inside `dpbert/` and an
editable install finds them here. `dpbert.release.card` renders them; `golden/` holds rendered cards
that `tests/test_model_cards.py` regenerates and compares.
"""
