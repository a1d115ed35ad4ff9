"""Model definitions as pure stage functions: building blocks and one module per family."""
