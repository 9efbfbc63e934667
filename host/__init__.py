"""pie host: runs a transformers model and lets WebAssembly inferlets drive generation."""
