"""The engine: torch only, no Ray. Holds the bases, caches decoded variants, batches rows."""
