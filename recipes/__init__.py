"""Runnable recipes (TOML) shipped with fmoe."""
