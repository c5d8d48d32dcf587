"""The KV cache: its blocks, the prefix cache over them, and the attention that reads them."""
