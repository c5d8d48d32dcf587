"""Correction families: the slots a base's variants sit in during a forward, their pools, and the wrapper
modules that apply them."""
