"""On-disk format: names, safetensors headers, manifests and checksums. Pure Python: no torch, no I/O."""
