"""The on-disk store: bytes on disk -> validated tensors and manifests."""
