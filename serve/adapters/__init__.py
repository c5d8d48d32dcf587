"""PEFT adapters for a served base: training data, LoRA / PiSSA training, PiSSA -> LoRA conversion."""
