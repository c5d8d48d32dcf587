"""Real models and data that ship inside packages (no hub at run time), with fixed train/test splits."""
