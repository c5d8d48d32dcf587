"""A base held in NeuZip form: its coded weights, decoded layer by layer around each forward."""
