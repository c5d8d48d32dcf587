"""Variant kinds: one module per kind of fine-tune, each stored against a base in the store."""
