"""Triton kernels, each beside the plain-torch reference its tests compare against."""
