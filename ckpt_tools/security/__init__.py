"""Untrusted input read safely: files opened inside their checkpoint, pickles parsed by restricted
readers into inert trees (nothing from a file runs), trees measured before anything walks them."""
