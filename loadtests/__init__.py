"""Load tests against a server on 127.0.0.1: Manyfold and two baselines, run the same way."""
