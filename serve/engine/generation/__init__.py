"""Continuous batching for a causal LM: the running batch, sampling, structured outputs, detokenising."""
