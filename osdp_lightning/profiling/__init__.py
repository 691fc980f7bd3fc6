"""Measuring a model: its units, the tensors its step saves, a real profiled step, a fake step
from shapes, optimizer state, precision and materializing a meta-device model."""
