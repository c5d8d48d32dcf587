"""One generation step's forward: its plan, its layout, its fused layers and its CUDA graphs."""
